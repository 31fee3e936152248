//! Job output through pipes, copied by the agent up to `max_output_bytes`.
//!
//! The job's stdout and stderr are pipes (one pipe for both with `-j oe` /
//! `eo`). The output files are still opened by the job process **as the
//! owner** (`O_NOFOLLOW`, before exec, see [`crate::spawn`]) and handed to
//! the agent over `SCM_RIGHTS`; the job itself never holds them. One
//! blocking thread per pipe moves the bytes into its file with `splice(2)`
//! (no copy through user space; plain `read`/`write` where the file system
//! refuses splice), never writing past the cap: a file holds at most
//! `max_output_bytes` bytes, the first ones the job wrote, with no slack.
//! The first byte past the cap marks the stream as over
//! ([`Copier::over`]); the supervisor then stops the job (`output-limit`)
//! while the copier keeps draining the pipe into nothing, so a job that
//! handles SIGTERM is not stuck in `write` meanwhile.
//!
//! A copier ends at end of file (every process of the job closed the
//! pipe) or when its stop pipe is closed (a leftover process that was not
//! found keeps the pipe open; the supervisor gives up on it after
//! [`DRAIN_AFTER_END`]).

use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{splice, SpliceFFlags};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use prometheus_client::metrics::counter::Counter;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Bytes moved per `splice`/`read` (the default pipe capacity).
const CHUNK: usize = 64 * 1024;

/// How long the agent keeps copying after every known process of the job
/// has ended, waiting for the pipes to reach end of file, before it gives up
/// on what is left in them.
pub const DRAIN_AFTER_END: Duration = Duration::from_secs(5);

/// What one copier did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copied {
    /// Bytes written into the file (at most the cap).
    pub bytes: u64,
    /// Whether the job wrote more than the cap into this stream.
    pub over: bool,
}

/// Where a copier's bytes go.
enum Sink<'a> {
    /// `splice` into the file.
    Splice(&'a OwnedFd),
    /// `write` into the file (the file system refused splice).
    Write(&'a OwnedFd),
    /// Read and drop (past the cap, after a write error, or no file).
    Discard,
}

/// Copies `pipe` into `file` until end of file or until `stop` becomes
/// readable or hung up, writing at most `cap` bytes (`0` = no cap). The first
/// byte past the cap cancels `over` and is dropped, like everything after
/// it. With `file` `None` everything is dropped. Blocking: run it on its
/// own thread.
///
/// A failed write to the file (e.g. `ENOSPC`, the owner's quota) is logged
/// once and the rest is dropped; the job is not stopped for it. Bytes
/// written into the file are added to `counted` as they are written (the
/// agent's `vq_agent_output_bytes_written_total`).
///
/// # Errors
/// A failing `poll` or `read` of the pipe (the copier then stops and the
/// job's further writes fail with `EPIPE`).
pub fn copy_capped(
    pipe: &OwnedFd,
    file: Option<&OwnedFd>,
    cap: u64,
    stop: &OwnedFd,
    over: &CancellationToken,
    counted: &Counter,
) -> std::io::Result<Copied> {
    let mut sink = file.map_or(Sink::Discard, Sink::Splice);
    let mut buf = vec![0u8; CHUNK];
    let mut written: u64 = 0;
    let mut exceeded = false;
    loop {
        let (data, stopped) = {
            let mut fds = [
                PollFd::new(pipe.as_fd(), PollFlags::POLLIN),
                PollFd::new(stop.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => {}
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
            let ready = |f: &PollFd| f.revents().is_some_and(|r| !r.is_empty());
            (ready(&fds[0]), ready(&fds[1]))
        };
        if stopped {
            break;
        }
        if !data {
            continue;
        }
        let room = if cap == 0 {
            CHUNK
        } else {
            (cap - written).min(CHUNK as u64) as usize
        };
        if room == 0 && !exceeded {
            // Data is waiting and the file is full: the cap is exceeded.
            match nix::unistd::read(pipe, &mut buf[..1]) {
                Ok(0) => break,
                Ok(_) => {
                    exceeded = true;
                    over.cancel();
                    sink = Sink::Discard;
                }
                Err(Errno::EINTR | Errno::EAGAIN) => {}
                Err(e) => return Err(e.into()),
            }
            continue;
        }
        match sink {
            Sink::Splice(fd) => {
                match splice(pipe, None, fd, None, room, SpliceFFlags::SPLICE_F_NONBLOCK) {
                    Ok(0) => break,
                    Ok(n) => {
                        written += n as u64;
                        counted.inc_by(n as u64);
                    }
                    Err(Errno::EINTR | Errno::EAGAIN) => {}
                    Err(Errno::EINVAL | Errno::ENOSYS) => sink = Sink::Write(fd),
                    Err(e) => {
                        warn!(error = %e, "cannot write the job's output file; the rest of this stream is dropped");
                        sink = Sink::Discard;
                    }
                }
            }
            Sink::Write(fd) => match nix::unistd::read(pipe, &mut buf[..room]) {
                Ok(0) => break,
                Ok(n) => match write_all(fd, &buf[..n]) {
                    Ok(()) => {
                        written += n as u64;
                        counted.inc_by(n as u64);
                    }
                    Err(e) => {
                        warn!(error = %e, "cannot write the job's output file; the rest of this stream is dropped");
                        sink = Sink::Discard;
                    }
                },
                Err(Errno::EINTR | Errno::EAGAIN) => {}
                Err(e) => return Err(e.into()),
            },
            Sink::Discard => match nix::unistd::read(pipe, &mut buf) {
                Ok(0) => break,
                Ok(_) | Err(Errno::EINTR | Errno::EAGAIN) => {}
                Err(e) => return Err(e.into()),
            },
        }
    }
    Ok(Copied {
        bytes: written,
        over: exceeded,
    })
}

fn write_all(fd: &OwnedFd, mut bytes: &[u8]) -> nix::Result<()> {
    while !bytes.is_empty() {
        match nix::unistd::write(fd, bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(Errno::EINTR) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    /// Writes `n` bytes into a pipe, closes it, and copies it with `cap`.
    fn run(n: usize, cap: u64) -> (Copied, Vec<u8>, bool) {
        let (rd, wr) = nix::unistd::pipe().unwrap();
        let writer = std::thread::spawn(move || {
            let mut w = std::fs::File::from(wr);
            let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
            // Past the cap the copier drains into nothing: never EPIPE.
            w.write_all(&data).unwrap();
        });
        let mut file = tempfile::tempfile().unwrap();
        let fd = OwnedFd::from(file.try_clone().unwrap());
        let (stop_rd, _stop_wr) = nix::unistd::pipe().unwrap();
        let over = CancellationToken::new();
        let counted = Counter::default();
        let copied = copy_capped(&rd, Some(&fd), cap, &stop_rd, &over, &counted).unwrap();
        assert_eq!(counted.get(), copied.bytes, "every byte written is counted");
        writer.join().unwrap();
        let mut out = Vec::new();
        file.rewind().unwrap();
        file.read_to_end(&mut out).unwrap();
        (copied, out, over.is_cancelled())
    }

    #[test]
    fn a_stream_over_the_cap_is_cut_at_the_cap_and_marked_over() {
        let (copied, out, over) = run(1_000_000, 100_000);
        assert_eq!(copied.bytes, 100_000);
        assert_eq!(out.len(), 100_000, "no slack past the cap");
        assert!(copied.over && over);
        let want: Vec<u8> = (0..100_000).map(|i| (i % 251) as u8).collect();
        assert_eq!(out, want, "the file holds the first bytes");
    }

    #[test]
    fn a_stream_of_exactly_the_cap_is_not_over_and_zero_means_no_cap() {
        let (copied, out, over) = run(100_000, 100_000);
        assert_eq!(
            (copied.bytes, out.len(), copied.over, over),
            (100_000, 100_000, false, false)
        );
        let (copied, out, over) = run(300_000, 0);
        assert_eq!(
            (copied.bytes, out.len(), copied.over, over),
            (300_000, 300_000, false, false)
        );
    }

    #[test]
    fn closing_the_stop_pipe_ends_a_copier_whose_pipe_stays_open() {
        let (rd, _wr_kept_open) = nix::unistd::pipe().unwrap();
        let (stop_rd, stop_wr) = nix::unistd::pipe().unwrap();
        let t = std::thread::spawn(move || {
            copy_capped(
                &rd,
                None,
                0,
                &stop_rd,
                &CancellationToken::new(),
                &Counter::default(),
            )
            .unwrap()
        });
        drop(stop_wr);
        assert_eq!(t.join().unwrap().bytes, 0);
    }
}
