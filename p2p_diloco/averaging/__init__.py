"""Per-fragment background averaging among live peers: one hivemind averager per fragment.

A round of fragment f is a hivemind group all-reduce of the members' encoded pseudo-gradients
(:func:`p2p_diloco.core.outer.encode_contribution`), weighted by progress, among whoever is alive and due
within the matchmaking window (at least ``averaging.min_group_size`` peers). Every member then
decodes the *same* averaged tensors with the *same* gathered metadata and applies the same outer
step to the same anchor, so anchors stay identical inside a group. What makes that true, and what
this package adds to hivemind 1.1.12 (see ``docs/design.md``, "What hivemind 1.1.12 does here"):

* **Same bytes for everyone** (:class:`ExactAllReduceRunner`). hivemind's reducer sends each
  sender ``codec(average - x_sender)`` and the sender adds it to its own tensor, so with a lossy
  codec (and even with fp32 rounding) every peer ends with a slightly different result. Our
  reducer sends ``codec(average)`` itself -- the same deterministic bytes to every sender, and
  decodes the same bytes for its own share -- and senders *copy* what they receive. Every member
  then holds bit-identical averaged tensors, at no extra traffic (one message per part, as before).
  The price: the codec error is relative to the average, not to the difference from it.
* **Partial rounds fail** (:meth:`ExactAllReduceRunner.completeness_problem`). hivemind can finish
  a round with some parts replaced by the local tensor (a reducer that failed) or some senders
  dropped (banned after a timeout), and report success. We check the runner's own books after
  every round and raise instead, so ``step()`` fails; a round that fails is discarded by the
  learner, never half-applied, and its pseudo-gradient is kept for the next round. A sender is
  dropped (banned) for a malformed part; a part whose only fault is non-finite values is not a
  partial round: its reducer leaves it out of that part's average and still answers the sender
  (``ExactAllReduceRunner.left_out``), so a member that sends NaN every round blocks nothing. A part
  that no sender sent finite fails the round.
* **Group-atomic commit** (:func:`commit_decision`). A partial all-reduce is not always visible to
  every member: when a reducer drops a sender, the third peer gets a "successful" average that
  lacks one contribution. So after the all-reduce each member posts its verdict (signed, in the
  DHT, under a key only this attempt's members derive) and commits only if every member reported
  success within ``commit_timeout_s``; silence is a veto. A member whose own all-reduce failed
  posts its veto from the averager process at once (:meth:`FragmentAveragerProcess._post_veto`), so the
  others do not wait out the timeout. (Two-phase commit without a coordinator cannot be perfect: a
  verdict read just after a member's deadline makes one member abort while the others commit;
  versions then differ. A member that gives up for want of verdicts withdraws its "ok" -- a late member then
  discards too -- and keeps the round's result, committed late if a peer turns out to hold exactly it:
  :meth:`~p2p_diloco.sync.fragment.FragmentSync.adopt_pending`. Otherwise the behind member downloads.)
* **Checked metadata** (:func:`check_group`). Each member gathers (fragment, version, anchor hash,
  config hash, tokens, steps, weight, radial norms, due time) from all the others; a round whose
  members disagree on the anchor, or whose weights are not what their progress says, or all zero
  (hivemind would return NaN), is discarded by every member -- the decision is a pure function of
  the gathered data, so all members take the same one.
* **Bounded influence** (``outer.robust``, :class:`RobustTensorPartReducer`). A member that sends
  1000x tensors or norms must not steer the anchor. Each reducer averages the parts it receives with
  :func:`outer.robust_mean` (norms capped at ``clip_factor`` x the senders' lower median, non-finite
  parts left out as by the plain reducer, and with "trim" a coordinate-wise trimmed mean), weighting
  senders by their *gathered* weights capped the same way -- not by what they claim in the stream;
  every member applies the same rule to the gathered norms (:func:`outer.decode_merged`). One
  reducer computes each part for everyone, so anchors stay bit-identical.
* **Versioned groups**: the group key carries the fragment version and a few bits of the anchor
  hash (``set_group_bits``), so only peers holding the same anchor meet; a peer behind the swarm
  finds nobody and fetches the current anchor + outer state from a peer that has it
  (:meth:`FragmentAveragerHost.fetch_state`), accepted only if a peer other than its donor signed that
  anchor (:func:`vouchers`; every committer signs its new anchor, :meth:`FragmentAveragerHost.vouch`).
* **Forks heal** (:func:`anchor_order`). hivemind matchmaking can split the peers due for a round
  into two groups that each commit the same version from the same anchor, with different results.
  The (version, anchor hash) pairs are totally ordered -- at equal versions the smaller hash wins --
  and a peer that sees (in the peer records) a peer ahead of it downloads that anchor and rebases
  onto it, like a peer that missed rounds. The distance between the two anchors is measured then
  (:func:`relative_distance`) and published as the peer's consensus distance.
* **Grid groups** (``averaging.groups = "grid"``, docs/design.md "Bounded groups"): a round's groups of at most
  ``target_group_size`` lie on a grid that changes every round and meet under their own key
  (:func:`grid_group_bits`), not the version's. Members may hold other versions and anchors: the all-reduce
  averages their anchors and outer momenta (``ANCHOR_TENSOR``, ``MOMENTUM_TENSOR``) beside the pseudo-gradients,
  the group commits :func:`grid_version`, and no fork is healed. A member's anchor then weighs in like its
  pseudo-gradient: the robust merge's norm cap bounds how far one member can pull it.
* **Groups from the clock** (``averaging.matchmaking = "clock"``, :mod:`.fixed_groups`): the round's group is
  planned from the clock's round and the records (:func:`p2p_diloco.core.groups.clock_group`); its members fetch
  each other's offers (what matchmaking would have gathered) with one request each and run the all-reduce on that
  exact group -- no DHT search, no window -- and send their verdicts to each other directly instead of through the
  DHT. A member missing by the scheduled time fails the round for all alike, before any tensor moves.
* **Members only** (when a swarm key is in use): our averaging and state-download handlers refuse
  peers that :class:`p2p_diloco.net.membership.Membership` does not list; the DHT authorizer does not
  cover these RPCs.

hivemind surprise: RPC handler names carry the servicer's *class name*, so every peer must serve
the handlers of the same averager class; the faulty averager of fault injection (:mod:`.faulty`,
chosen only when ``join --fault`` arms faults) is a subclass that keeps its parent's handler names.

Every hivemind timeout is set for each round from the bytes it moves and the link measured in earlier rounds
(:mod:`p2p_diloco.averaging.linktime`), never below the values of
:class:`~p2p_diloco.core.config.AveragingConfig` (seconds), and ``allow_retries=False``: a failed round is
reported, not silently retried with other tensors.
"""
