//! vq controller library: the stateless reconcile loop (`vq-controller`) and
//! the user/admin CLI (`vq`).

pub mod cli;
