"""Elastic membership: a store-based buffer survives a killed rank and re-admits its restarted process,
rebuilding only the links to it. docs/elastic.md is the protocol page. membership.py is the protocol
(announcements, generations, the admission handshake), slots.py its numbered compare_set slots
(generations, the announcement index), mailbox.py the reference backend's store-keyed data path; the
native backend's side is pyep.ep.ll.native_member. drill_rank.py is one rank of the drill that kills,
restarts and checks ranks (`pyep drill`); it drives an EpBuffer, so it sits above pyep.ep.ll and
nothing in the package imports it. Importing this package does not import torch."""
