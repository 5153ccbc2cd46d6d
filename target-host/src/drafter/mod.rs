//! Drafter processes: spawn, handshake, supervision (in progress).
