//! `#PBS` directive parsing (to be written).
