"""Tools over the transports: the transfer benchmark, the info probe, and the peer process both drive."""
