"""One fragment's sync state on a learner (:class:`~p2p_diloco.sync.slot.FragmentSlot`) and its state machine
(:class:`~p2p_diloco.sync.fragment.FragmentSync`): hand off, apply a round, rebase onto a download. The same
machine runs under the networked engine and the simulator; it knows no transport, only a protocol."""
