"""Private swarm: the shared-secret authorizer every DHT RPC carries."""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Any

from hivemind.proto import dht_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import get_dht_time
from hivemind.utils.auth import (
    AuthorizedRequestBase,
    AuthorizedResponseBase,
    TokenAuthorizerBase,
)
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

logger = logging.getLogger(__name__)


MAX_DHT_CLOCK_SKEW_S = 3.0
"""hivemind's ``MAX_DHT_TIME_DISCREPANCY_SECONDS``: peers whose clocks differ more are refused."""


class SwarmKeyAuthorizer(TokenAuthorizerBase):
    """hivemind token authorizer whose tokens are HMAC-signed with the swarm secret.

    Each peer mints its own token: (public key, expiry) signed with HMAC(secret). hivemind signs
    every DHT request/response with the peer's RSA key and checks the other side's token, so a
    peer without the secret gets no answers (and gives none that we accept). Verified here: a
    joiner with no key or another key fails the bootstrap ping in ~0.3 s; a keyed joiner of an
    open swarm fails the same way.

    Clock skew: hivemind also refuses requests whose timestamp is more than 60 s off ours (replay
    protection), and tokens carry an expiry in the minter's clock. A keyed joiner whose clock is
    minutes off would then get silence and be told "swarm key mismatch". So a *ping* that is
    genuinely keyed (HMAC and RSA signature valid) but refused only for its time is answered
    anyway (a replayed ping does nothing but add its sender to the routing table): hivemind's
    bootstrap check then fails the join with "local time must be within 3 seconds"
    (:func:`explain_join_failure` turns that into our one-line clock-skew error). Verified here
    for +-10 s, +-120 s and +-2 h. Every other request keeps hivemind's checks.
    """

    TOKEN_LIFETIME_S = 3600.0
    REFRESH_MARGIN_S = 300.0
    USERNAME = "p2p-diloco"

    def __init__(self, secret: bytes, private_key: RSAPrivateKey):
        super().__init__(private_key)
        self._mac_key = hashlib.sha256(b"p2p-diloco swarm token\0" + secret).digest()
        self.refused = 0
        """DHT requests refused so far (no or another swarm key, replayed, bad signature); in the DHT process."""

    def _mac(self, token: AccessToken) -> bytes:
        message = b"\0".join([token.username.encode(), token.public_key, token.expiration_time.encode()])
        return hmac.new(self._mac_key, message, hashlib.sha256).digest()

    async def get_token(self) -> AccessToken:
        token = AccessToken(
            username=self.USERNAME,
            public_key=self.local_public_key.to_bytes(),
            expiration_time=repr(get_dht_time() + self.TOKEN_LIFETIME_S),
        )
        token.signature = self._mac(token)
        return token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        if not hmac.compare_digest(access_token.signature, self._mac(access_token)):
            logger.debug("token rejected: not signed with our swarm key")
            return False
        try:
            expires = float(access_token.expiration_time)
        except ValueError:
            return False
        return expires > get_dht_time()

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return float(access_token.expiration_time) < get_dht_time() + self.REFRESH_MARGIN_S

    def _signed_by_keyed_peer(self, message: Any, token: AccessToken, signature: bytes) -> bool:
        """The token is HMAC-signed with our secret (its expiry aside) and ``message`` is signed by its key."""
        if not hmac.compare_digest(token.signature, self._mac(token)):
            return False
        message.auth.signature = b""  # what the sender signed (hivemind's own check clears it too)
        return RSAPublicKey.from_bytes(token.public_key).verify(message.SerializeToString(), signature)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        signature = request.auth.signature
        if await super().validate_request(request):
            return True
        offset_s = request.auth.time - get_dht_time()
        if (isinstance(request, dht_pb2.PingRequest) and abs(offset_s) > MAX_DHT_CLOCK_SKEW_S
                and self._signed_by_keyed_peer(request, request.auth.client_access_token, signature)):
            logger.warning("a peer with our swarm key pinged us with a clock %+.1f s off ours; answering so that it "
                           "learns why it cannot join (it must synchronise its clock)", offset_s)
            return True
        self.refused += 1
        logger.debug("refused a DHT request (%s): no valid swarm token, bad signature, replayed or clock off",
                     type(request).__name__)
        return False

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        signature = response.auth.signature
        if await super().validate_response(response, request):
            return True
        # a keyed peer's ping answer whose token looks expired to us: its clock is far off ours
        return (isinstance(response, dht_pb2.PingResponse) and response.auth.nonce == request.auth.nonce
                and abs(response.dht_time - get_dht_time()) > MAX_DHT_CLOCK_SKEW_S
                and self._signed_by_keyed_peer(response, response.auth.service_access_token, signature))


