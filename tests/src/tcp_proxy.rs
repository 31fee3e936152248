//! A TCP proxy for network fault tests: put it between a client (the
//! jobagent) and a server (a private RabbitMQ node) and switch it to
//! **blackhole**: a silent partition, as when a switch or a security group
//! drops every packet. Nothing is forwarded in either direction and no
//! socket is closed, so neither side gets a FIN or a RST; each side notices
//! only through its own timeouts (AMQP heartbeats). Bytes read before or
//! sent during the partition are held, not dropped, as TCP retransmission
//! would deliver them once the path heals; a peer that gave up meanwhile
//! gets them on a socket it closed. Connections accepted during a partition
//! are held unconnected until it heals (a SYN that gets no answer).
//! [`TcpProxy::heal`] resumes forwarding; [`TcpProxy::cut`] resets every
//! open connection (RST to both sides), as a restarting firewall would.
//!
//! It runs on the caller's tokio runtime and stops when dropped.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Shared between the proxy handle and its tasks.
#[derive(Debug)]
struct State {
    /// `true` while partitioned.
    blackholed: watch::Sender<bool>,
    /// Cancelled by [`TcpProxy::cut`] (and replaced by a fresh token).
    cut: Mutex<CancellationToken>,
    /// Connections accepted so far.
    accepted: AtomicUsize,
    /// Connections open now (accepted, not yet closed on both sides).
    open: AtomicUsize,
}

impl State {
    fn cut_token(&self) -> CancellationToken {
        self.cut.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A TCP proxy from a local port to `upstream` (see the module doc).
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    state: Arc<State>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl TcpProxy {
    /// Listens on a free port of 127.0.0.1 and forwards every connection to
    /// `upstream`.
    ///
    /// # Errors
    /// If the listening socket cannot be bound.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            blackholed: watch::channel(false).0,
            cut: Mutex::new(CancellationToken::new()),
            accepted: AtomicUsize::new(0),
            open: AtomicUsize::new(0),
        });
        let stop = CancellationToken::new();
        let task = tokio::spawn(accept_loop(listener, upstream, state.clone(), stop.clone()));
        Ok(TcpProxy {
            addr,
            upstream,
            state,
            stop,
            task,
        })
    }

    /// The local address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The local port clients connect to.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Where connections are forwarded.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Starts a silent partition: stop forwarding in both directions, keep
    /// every socket open.
    pub fn blackhole(&self) {
        self.state.blackholed.send_replace(true);
    }

    /// Ends the partition: held bytes and connections go through.
    pub fn heal(&self) {
        self.state.blackholed.send_replace(false);
    }

    /// Whether the proxy is partitioned now.
    pub fn is_blackholed(&self) -> bool {
        *self.state.blackholed.borrow()
    }

    /// Resets every open connection (RST to both sides); new connections
    /// are accepted as before.
    pub fn cut(&self) {
        let old = {
            let mut g = self.state.cut.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::replace(&mut *g, CancellationToken::new())
        };
        old.cancel();
    }

    /// Connections accepted since the start.
    pub fn accepted(&self) -> usize {
        self.state.accepted.load(Ordering::SeqCst)
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        self.state.open.load(Ordering::SeqCst)
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.cut();
        self.task.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    state: Arc<State>,
    stop: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.cancelled() => return,
        };
        let Ok((client, _)) = accepted else {
            // EMFILE and the like: do not spin.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        state.accepted.fetch_add(1, Ordering::SeqCst);
        state.open.fetch_add(1, Ordering::SeqCst);
        let cut = state.cut_token();
        let st = state.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = connection(client, upstream, &st) => {}
                _ = cut.cancelled() => {}
                _ = stop.cancelled() => {}
            }
            st.open.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

/// Waits until the proxy is not partitioned.
async fn passable(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|b| !*b).await;
}

/// Forwards one connection until both directions ended. Dropping this
/// future (a cut) resets both sockets: they are set to linger zero first.
async fn connection(client: TcpStream, upstream: SocketAddr, state: &State) {
    let _ = client.set_nodelay(true);
    let _ = client.set_zero_linger();
    let mut rx = state.blackholed.subscribe();
    // A connection attempt during a partition is answered by nobody.
    passable(&mut rx).await;
    let Ok(server) = TcpStream::connect(upstream).await else {
        return; // the client sees its connection closed, as when refused
    };
    let _ = server.set_nodelay(true);
    let _ = server.set_zero_linger();
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = pump(cr, sw, state.blackholed.subscribe());
    let down = pump(sr, cw, state.blackholed.subscribe());
    tokio::join!(up, down);
}

/// Copies `from` to `to`, holding everything while partitioned; on EOF
/// shuts down `to`'s write side, on an error returns (dropping the halves;
/// the other direction ends on its own).
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut rx: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        passable(&mut rx).await;
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => {
                // An EOF reached during a partition waits for the heal too.
                passable(&mut rx).await;
                let _ = to.shutdown().await;
                return;
            }
            Ok(n) => n,
        };
        // Read just before the partition began: held until it heals.
        passable(&mut rx).await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = l.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let mut b = [0u8; 1024];
                    loop {
                        match s.read(&mut b).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                if s.write_all(&b[..n]).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        addr
    }

    async fn read_some(s: &mut TcpStream, wait: Duration) -> Option<Vec<u8>> {
        let mut b = [0u8; 1024];
        match tokio::time::timeout(wait, s.read(&mut b)).await {
            Ok(Ok(n)) => Some(b[..n].to_vec()),
            Ok(Err(_)) => Some(Vec::new()),
            Err(_) => None,
        }
    }

    #[tokio::test]
    async fn forwards_holds_while_blackholed_and_cuts() {
        let proxy = TcpProxy::start(echo_server().await).await.unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        c.write_all(b"one").await.unwrap();
        assert_eq!(
            read_some(&mut c, Duration::from_secs(5)).await.as_deref(),
            Some(&b"one"[..])
        );
        proxy.blackhole();
        c.write_all(b"two").await.unwrap();
        // Silence: neither data nor a close.
        assert_eq!(read_some(&mut c, Duration::from_millis(300)).await, None);
        // A new connection is held too.
        let mut c2 = TcpStream::connect(proxy.addr()).await.unwrap();
        c2.write_all(b"three").await.unwrap();
        assert_eq!(read_some(&mut c2, Duration::from_millis(300)).await, None);
        proxy.heal();
        assert_eq!(
            read_some(&mut c, Duration::from_secs(5)).await.as_deref(),
            Some(&b"two"[..])
        );
        assert_eq!(
            read_some(&mut c2, Duration::from_secs(5)).await.as_deref(),
            Some(&b"three"[..])
        );
        assert_eq!(proxy.accepted(), 2);
        proxy.cut();
        // Reset (or closed): a read returns at once with nothing.
        assert_eq!(
            read_some(&mut c, Duration::from_secs(5)).await.as_deref(),
            Some(&b""[..])
        );
        let mut c3 = TcpStream::connect(proxy.addr()).await.unwrap();
        c3.write_all(b"four").await.unwrap();
        assert_eq!(
            read_some(&mut c3, Duration::from_secs(5)).await.as_deref(),
            Some(&b"four"[..])
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(proxy.open_connections(), 1);
    }
}
