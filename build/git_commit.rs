// Shared by jobagent/build.rs, controller/build.rs and cli/build.rs (include!d).
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=VQ_GIT_COMMIT");
    println!("cargo:rerun-if-changed=../build/git_commit.rs");
    let commit = std::env::var("VQ_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=VQ_GIT_COMMIT={commit}");
}

/// `git rev-parse ARGS` in this crate's directory, trimmed; None on failure.
fn rev_parse(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("rev-parse")
        .args(args)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8(out.stdout).ok()?.trim().to_string())
}

/// The short hash of HEAD. Also asks cargo to rerun this script when HEAD
/// moves (a checkout, or a commit on the current branch).
fn git_commit() -> Option<String> {
    let commit = rev_parse(&["--short=12", "HEAD"])?;
    let git_dir = PathBuf::from(rev_parse(&["--absolute-git-dir"])?);
    let common = rev_parse(&["--git-common-dir"])
        .map(PathBuf::from)
        .map(|p| {
            if p.is_absolute() {
                p
            } else {
                PathBuf::from(".").join(p)
            }
        })
        .unwrap_or_else(|| git_dir.clone());
    let head = git_dir.join("HEAD");
    let mut watch = vec![head.clone()];
    if let Some(branch) = std::fs::read_to_string(&head)
        .ok()
        .and_then(|h| h.strip_prefix("ref: ").map(|b| b.trim().to_string()))
    {
        watch.push(common.join(branch));
        watch.push(common.join("packed-refs"));
    }
    // A path that does not exist would make cargo rerun this on every build.
    for path in watch.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    Some(commit)
}
