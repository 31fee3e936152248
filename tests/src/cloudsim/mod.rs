//! vq-cloudsim (being written).
