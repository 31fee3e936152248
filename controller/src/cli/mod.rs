//! `vq` CLI (being written).
