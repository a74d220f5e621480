"""An expert-parallel group's communication (torch.distributed): each rank's group endpoint, one process group per
membership epoch (a fresh rendezvous each), the collectives a step needs with their deadlines, and probing the peers
to name the one that is gone or frozen when a collective fails. Also the deadline that any rendezvous of this process
(an epoch's, a trainer's weight broadcast) is held to when its store accepts and never answers."""
