"""The software version: what peers publish in their records (``software_version``) and ``--version`` prints."""

VERSION = "0.1.0"
