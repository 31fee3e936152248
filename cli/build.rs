//! Puts the git commit of the build into `VQ_GIT_COMMIT`, so that
//! `--version` names it. `VQ_GIT_COMMIT` set in the environment wins (builds
//! from a source tarball); outside a git checkout it is "unknown".

include!("../build/git_commit.rs");
