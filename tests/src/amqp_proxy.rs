//! An AMQP 0-9-1 aware TCP proxy for protocol fault tests: put it between
//! a client (the jobagent) and a broker, add a [`Rule`], and the proxy
//! drops the connection at exactly one protocol step, e.g. "before the
//! publisher confirm of the 2nd publish to the lease queue reaches the
//! client" or "right after the client's `basic.ack` of a pool delivery
//! reached the broker".
//!
//! Both directions are parsed as AMQP frames (the client's 8-byte protocol
//! header, then `type u8, channel u16, size u32, payload, 0xCE`); method
//! frames are decoded into a [`Method`] (arguments for the methods vq uses,
//! class and method id for the others). Per connection and channel the
//! proxy tracks what a rule may need to name a step:
//!
//! * publisher confirms: after `confirm.select` every client
//!   `basic.publish` gets the next sequence number (from 1), and a broker
//!   `basic.ack` / `basic.nack` (`delivery-tag`, `multiple`) confirms the
//!   publishes it covers ([`Target::ConfirmOf`]);
//! * deliveries: the broker's `basic.deliver` / `basic.get-ok` delivery
//!   tags, settled by the client's `basic.ack` / `nack` / `reject`
//!   ([`Target::AckOf`]);
//! * synchronous replies: a client request (`queue.declare`, `basic.get`,
//!   ...) is answered by the next broker method of its reply kind on the
//!   channel, or by a `channel.close` ([`Target::ReplyTo`]). Requests with
//!   `no-wait` are recognised for `queue.declare` and `confirm.select`
//!   only (vq sends no other `no-wait` request).
//!
//! A rule fires once, on the `nth` match (counted over the whole proxy or
//! per connection): the proxy forwards the frames before the matching one
//! (and the matching one too with [`Action::CutAfter`]), then closes both
//! sockets of that connection at once ([`Close::Reset`] or [`Close::Fin`]).
//! Nothing after that frame is forwarded (a cut `basic.publish` loses its
//! content frames). Other connections are not affected; after the rule
//! fired, every connection passes through as before.
//!
//! It runs on the caller's tokio runtime and stops when dropped.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The protocol header a client sends first (`AMQP 0-9-1`).
pub const PROTOCOL_HEADER: [u8; 8] = *b"AMQP\x00\x00\x09\x01";
/// Frame type of a method frame.
pub const FRAME_METHOD: u8 = 1;
/// Frame type of a content header frame.
pub const FRAME_HEADER: u8 = 2;
/// Frame type of a content body frame.
pub const FRAME_BODY: u8 = 3;
/// Frame type of a heartbeat frame.
pub const FRAME_HEARTBEAT: u8 = 8;
/// The octet that ends every frame.
pub const FRAME_END: u8 = 0xCE;

/// Largest frame payload the parser accepts (bytes); a larger size field
/// means the stream is not AMQP (the proxy then forwards it unparsed).
const MAX_FRAME: usize = 16 * 1024 * 1024;

/// Which way a frame travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From the client to the broker.
    ToBroker,
    /// From the broker to the client.
    ToClient,
}

/// A decoded method frame. Arguments are decoded for the methods vq's
/// claim and release protocol uses; any other method is [`Method::Other`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Method {
    /// `channel.open` (20,10).
    ChannelOpen,
    /// `channel.close` (20,40).
    ChannelClose {
        /// Reply code (e.g. 404).
        reply_code: u16,
        /// Reply text.
        reply_text: String,
    },
    /// `channel.close-ok` (20,41).
    ChannelCloseOk,
    /// `queue.declare` (50,10).
    QueueDeclare {
        /// Queue name.
        queue: String,
        /// Passive (only check that it exists).
        passive: bool,
        /// No reply expected.
        no_wait: bool,
    },
    /// `queue.declare-ok` (50,11).
    QueueDeclareOk {
        /// Queue name.
        queue: String,
        /// Ready messages.
        message_count: u32,
        /// Consumers.
        consumer_count: u32,
    },
    /// `basic.publish` (60,40).
    BasicPublish {
        /// Exchange (`""`: the default exchange).
        exchange: String,
        /// Routing key.
        routing_key: String,
        /// Mandatory flag.
        mandatory: bool,
    },
    /// `basic.return` (60,50).
    BasicReturn {
        /// Reply code (312: no route).
        reply_code: u16,
        /// Exchange of the returned publish.
        exchange: String,
        /// Routing key of the returned publish.
        routing_key: String,
    },
    /// `basic.deliver` (60,60).
    BasicDeliver {
        /// Consumer tag.
        consumer_tag: String,
        /// Delivery tag (per channel).
        delivery_tag: u64,
        /// Redelivered flag.
        redelivered: bool,
        /// Exchange the message was published to.
        exchange: String,
        /// Its routing key.
        routing_key: String,
    },
    /// `basic.get` (60,70).
    BasicGet {
        /// Queue name.
        queue: String,
        /// Auto-ack.
        no_ack: bool,
    },
    /// `basic.get-ok` (60,71).
    BasicGetOk {
        /// Delivery tag (per channel).
        delivery_tag: u64,
        /// Redelivered flag.
        redelivered: bool,
        /// Exchange the message was published to.
        exchange: String,
        /// Its routing key.
        routing_key: String,
        /// Messages left in the queue.
        message_count: u32,
    },
    /// `basic.get-empty` (60,72).
    BasicGetEmpty,
    /// `basic.ack` (60,80): a client's ack of deliveries, or a broker's
    /// publisher confirm.
    BasicAck {
        /// Delivery tag or publish sequence number.
        delivery_tag: u64,
        /// Covers every tag up to `delivery_tag`.
        multiple: bool,
    },
    /// `basic.reject` (60,90).
    BasicReject {
        /// Delivery tag.
        delivery_tag: u64,
        /// Requeue.
        requeue: bool,
    },
    /// `basic.nack` (60,120).
    BasicNack {
        /// Delivery tag or publish sequence number.
        delivery_tag: u64,
        /// Covers every tag up to `delivery_tag`.
        multiple: bool,
        /// Requeue (client side).
        requeue: bool,
    },
    /// `confirm.select` (85,10).
    ConfirmSelect {
        /// No reply expected.
        no_wait: bool,
    },
    /// Any other method, by class and method id.
    Other {
        /// Class id.
        class: u16,
        /// Method id.
        method: u16,
    },
}

impl Method {
    /// (class id, method id).
    pub fn id(&self) -> (u16, u16) {
        match self {
            Method::ChannelOpen => (20, 10),
            Method::ChannelClose { .. } => (20, 40),
            Method::ChannelCloseOk => (20, 41),
            Method::QueueDeclare { .. } => (50, 10),
            Method::QueueDeclareOk { .. } => (50, 11),
            Method::BasicPublish { .. } => (60, 40),
            Method::BasicReturn { .. } => (60, 50),
            Method::BasicDeliver { .. } => (60, 60),
            Method::BasicGet { .. } => (60, 70),
            Method::BasicGetOk { .. } => (60, 71),
            Method::BasicGetEmpty => (60, 72),
            Method::BasicAck { .. } => (60, 80),
            Method::BasicReject { .. } => (60, 90),
            Method::BasicNack { .. } => (60, 120),
            Method::ConfirmSelect { .. } => (85, 10),
            Method::Other { class, method } => (*class, *method),
        }
    }

    /// Exchange and routing key of a publish, deliver, get-ok or return.
    pub fn exchange_and_key(&self) -> Option<(&str, &str)> {
        match self {
            Method::BasicPublish {
                exchange,
                routing_key,
                ..
            }
            | Method::BasicDeliver {
                exchange,
                routing_key,
                ..
            }
            | Method::BasicGetOk {
                exchange,
                routing_key,
                ..
            }
            | Method::BasicReturn {
                exchange,
                routing_key,
                ..
            } => Some((exchange, routing_key)),
            _ => None,
        }
    }

    /// Whether this is a `basic.publish` to `exchange` with `routing_key`.
    pub fn is_publish_to(&self, exchange: &str, routing_key: &str) -> bool {
        matches!(self, Method::BasicPublish { .. })
            && self.exchange_and_key() == Some((exchange, routing_key))
    }

    /// Whether this is a delivery (`basic.deliver` or `basic.get-ok`) of a
    /// message published to `exchange` with `routing_key`.
    pub fn is_delivery_of(&self, exchange: &str, routing_key: &str) -> bool {
        matches!(
            self,
            Method::BasicDeliver { .. } | Method::BasicGetOk { .. }
        ) && self.exchange_and_key() == Some((exchange, routing_key))
    }
}

/// Frame-decoding error (the stream is not AMQP 0-9-1).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    /// The client did not start with the AMQP 0-9-1 protocol header.
    #[error("read the protocol header: got {0:?}")]
    BadHeader(Vec<u8>),
    /// A frame did not end with 0xCE.
    #[error("read a frame: end octet {0:#04x}, not 0xce")]
    BadFrameEnd(u8),
    /// A frame's size field exceeds the parser's limit.
    #[error("read a frame: size {0} bytes is too large")]
    TooLarge(usize),
    /// A method frame's arguments are truncated or malformed.
    #[error("decode the arguments of method ({class},{method})")]
    BadArguments {
        /// Class id.
        class: u16,
        /// Method id.
        method: u16,
    },
}

/// One frame read off the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Frame type ([`FRAME_METHOD`], ...).
    pub kind: u8,
    /// Channel number.
    pub channel: u16,
    /// Payload (without the 7-byte header and the end octet).
    pub payload: Vec<u8>,
    /// Length on the wire, bytes (payload + 8).
    pub wire_len: usize,
}

/// Incremental frame splitter for one direction of a connection: feed it
/// bytes as they arrive ([`FrameReader::push`]), take complete frames
/// ([`FrameReader::next_frame`]).
#[derive(Debug)]
pub struct FrameReader {
    buf: Vec<u8>,
    pos: usize,
    header_pending: bool,
}

impl FrameReader {
    /// A reader for the client's side (expects the protocol header first).
    pub fn client() -> Self {
        FrameReader {
            buf: Vec::new(),
            pos: 0,
            header_pending: true,
        }
    }

    /// A reader for the broker's side (frames from the first byte; a
    /// protocol header sent back to refuse a version is skipped).
    pub fn broker() -> Self {
        FrameReader {
            buf: Vec::new(),
            pos: 0,
            header_pending: false,
        }
    }

    /// Appends received bytes.
    pub fn push(&mut self, data: &[u8]) {
        if self.pos > 0 && self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
        }
        self.buf.extend_from_slice(data);
    }

    /// Bytes received but not yet returned as frames.
    pub fn pending(&self) -> &[u8] {
        &self.buf[self.pos..]
    }

    /// Takes the pending bytes (for forwarding a stream that is not AMQP).
    pub fn take_pending(&mut self) -> Vec<u8> {
        let out = self.buf[self.pos..].to_vec();
        self.buf.clear();
        self.pos = 0;
        out
    }

    /// The next complete frame: `Ok(None)` if more bytes are needed. The
    /// client's protocol header is returned as a pseudo-frame of kind 0
    /// with the 8 header bytes as payload.
    ///
    /// # Errors
    /// [`FrameError`] if the bytes are not AMQP 0-9-1 frames.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        let rest = &self.buf[self.pos..];
        let header_here = self.header_pending || (self.pos == 0 && rest.starts_with(b"AMQP"));
        if header_here {
            if rest.len() < 8 {
                if !PROTOCOL_HEADER.starts_with(&rest[..rest.len().min(4)]) && rest.len() >= 4 {
                    return Err(FrameError::BadHeader(rest.to_vec()));
                }
                return Ok(None);
            }
            if &rest[..4] != b"AMQP" {
                return Err(FrameError::BadHeader(rest[..8].to_vec()));
            }
            let payload = rest[..8].to_vec();
            self.pos += 8;
            self.header_pending = false;
            return Ok(Some(Frame {
                kind: 0,
                channel: 0,
                payload,
                wire_len: 8,
            }));
        }
        if rest.len() < 7 {
            return Ok(None);
        }
        let size = u32::from_be_bytes([rest[3], rest[4], rest[5], rest[6]]) as usize;
        if size > MAX_FRAME {
            return Err(FrameError::TooLarge(size));
        }
        if rest.len() < size + 8 {
            return Ok(None);
        }
        let end = rest[7 + size];
        if end != FRAME_END {
            return Err(FrameError::BadFrameEnd(end));
        }
        let frame = Frame {
            kind: rest[0],
            channel: u16::from_be_bytes([rest[1], rest[2]]),
            payload: rest[7..7 + size].to_vec(),
            wire_len: size + 8,
        };
        self.pos += size + 8;
        Ok(Some(frame))
    }
}

/// Cursor over method arguments.
struct Args<'a> {
    b: &'a [u8],
}

impl<'a> Args<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.b.len() < n {
            return None;
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Some(h)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|b| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_be_bytes(a)
        })
    }
    fn shortstr(&mut self) -> Option<String> {
        let n = self.u8()? as usize;
        self.take(n)
            .map(|b| String::from_utf8_lossy(b).into_owned())
    }
}

/// Decodes the payload of a method frame.
///
/// # Errors
/// [`FrameError::BadArguments`] if a decoded method's arguments are
/// truncated (or the payload is shorter than its class and method ids).
pub fn parse_method(payload: &[u8]) -> Result<Method, FrameError> {
    let bad = |class, method| FrameError::BadArguments { class, method };
    if payload.len() < 4 {
        return Err(bad(0, 0));
    }
    let class = u16::from_be_bytes([payload[0], payload[1]]);
    let method = u16::from_be_bytes([payload[2], payload[3]]);
    let mut a = Args { b: &payload[4..] };
    let m = (|| {
        Some(match (class, method) {
            (20, 10) => Method::ChannelOpen,
            (20, 40) => Method::ChannelClose {
                reply_code: a.u16()?,
                reply_text: a.shortstr()?,
            },
            (20, 41) => Method::ChannelCloseOk,
            (50, 10) => {
                a.u16()?;
                let queue = a.shortstr()?;
                let bits = a.u8()?;
                Method::QueueDeclare {
                    queue,
                    passive: bits & 1 != 0,
                    no_wait: bits & 0x10 != 0,
                }
            }
            (50, 11) => Method::QueueDeclareOk {
                queue: a.shortstr()?,
                message_count: a.u32()?,
                consumer_count: a.u32()?,
            },
            (60, 40) => {
                a.u16()?;
                let exchange = a.shortstr()?;
                let routing_key = a.shortstr()?;
                let bits = a.u8()?;
                Method::BasicPublish {
                    exchange,
                    routing_key,
                    mandatory: bits & 1 != 0,
                }
            }
            (60, 50) => {
                let reply_code = a.u16()?;
                a.shortstr()?;
                Method::BasicReturn {
                    reply_code,
                    exchange: a.shortstr()?,
                    routing_key: a.shortstr()?,
                }
            }
            (60, 60) => Method::BasicDeliver {
                consumer_tag: a.shortstr()?,
                delivery_tag: a.u64()?,
                redelivered: a.u8()? & 1 != 0,
                exchange: a.shortstr()?,
                routing_key: a.shortstr()?,
            },
            (60, 70) => {
                a.u16()?;
                Method::BasicGet {
                    queue: a.shortstr()?,
                    no_ack: a.u8()? & 1 != 0,
                }
            }
            (60, 71) => Method::BasicGetOk {
                delivery_tag: a.u64()?,
                redelivered: a.u8()? & 1 != 0,
                exchange: a.shortstr()?,
                routing_key: a.shortstr()?,
                message_count: a.u32()?,
            },
            (60, 72) => Method::BasicGetEmpty,
            (60, 80) => Method::BasicAck {
                delivery_tag: a.u64()?,
                multiple: a.u8()? & 1 != 0,
            },
            (60, 90) => Method::BasicReject {
                delivery_tag: a.u64()?,
                requeue: a.u8()? & 1 != 0,
            },
            (60, 120) => {
                let delivery_tag = a.u64()?;
                let bits = a.u8()?;
                Method::BasicNack {
                    delivery_tag,
                    multiple: bits & 1 != 0,
                    requeue: bits & 2 != 0,
                }
            }
            (85, 10) => Method::ConfirmSelect {
                no_wait: a.u8()? & 1 != 0,
            },
            _ => Method::Other { class, method },
        })
    })();
    m.ok_or(bad(class, method))
}

/// The reply method ids a synchronous request expects (same class), or
/// `None` for a method that gets no reply. Connection-class methods are
/// not tracked.
fn reply_kinds(class: u16, method: u16) -> Option<&'static [u16]> {
    match (class, method) {
        (20, 10) => Some(&[11]),
        (20, 20) => Some(&[21]),
        (20, 40) => Some(&[41]),
        (40, 10) => Some(&[11]),
        (40, 20) => Some(&[21]),
        (40, 30) => Some(&[31]),
        (40, 40) => Some(&[51]),
        (50, 10) => Some(&[11]),
        (50, 20) => Some(&[21]),
        (50, 30) => Some(&[31]),
        (50, 40) => Some(&[41]),
        (50, 50) => Some(&[51]),
        (60, 10) => Some(&[11]),
        (60, 20) => Some(&[21]),
        (60, 30) => Some(&[31]),
        (60, 70) => Some(&[71, 72]),
        (60, 110) => Some(&[111]),
        (85, 10) => Some(&[11]),
        (90, 10) => Some(&[11]),
        (90, 20) => Some(&[21]),
        (90, 30) => Some(&[31]),
        _ => None,
    }
}

/// What one method frame means for the tracked state of its connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// For a broker `basic.ack`/`nack` on a confirm channel: the client
    /// publishes it confirms (oldest first).
    pub confirms: Vec<Method>,
    /// For a client `basic.ack`/`nack`/`reject`: the deliveries
    /// (`basic.deliver` / `basic.get-ok`) it settles (oldest first).
    pub settles: Vec<Method>,
    /// For a broker reply (or `channel.close`): the client request it
    /// answers.
    pub reply_to: Option<Method>,
}

#[derive(Debug, Default)]
struct ChannelState {
    /// `Some(next sequence number)` once `confirm.select` was sent.
    next_seq: Option<u64>,
    unconfirmed: BTreeMap<u64, Method>,
    unsettled: BTreeMap<u64, Method>,
    /// Requests waiting for their reply, oldest first.
    pending: VecDeque<Method>,
}

/// Per-connection protocol state: confirm sequence numbers, delivery tags
/// and pending synchronous requests, by channel. Pure (no I/O).
#[derive(Debug, Default)]
pub struct Tracker {
    channels: HashMap<u16, ChannelState>,
}

fn take_covered(map: &mut BTreeMap<u64, Method>, tag: u64, multiple: bool) -> Vec<Method> {
    if multiple {
        let keep = if tag == 0 {
            BTreeMap::new()
        } else {
            map.split_off(&(tag + 1))
        };
        std::mem::replace(map, keep).into_values().collect()
    } else {
        map.remove(&tag).into_iter().collect()
    }
}

impl Tracker {
    /// Records method `m` on `channel` travelling `dir` and returns what it
    /// confirms, settles or answers. Call it for every method frame of the
    /// connection in wire order (per direction), before forwarding it.
    pub fn observe(&mut self, dir: Direction, channel: u16, m: &Method) -> Observed {
        let mut out = Observed::default();
        if channel == 0 {
            return out;
        }
        if matches!(m, Method::ChannelOpen) && dir == Direction::ToBroker {
            self.channels.insert(channel, ChannelState::default());
        }
        let ch = self.channels.entry(channel).or_default();
        match (dir, m) {
            (Direction::ToBroker, Method::BasicPublish { .. }) => {
                if let Some(seq) = ch.next_seq.as_mut() {
                    ch.unconfirmed.insert(*seq, m.clone());
                    *seq += 1;
                }
            }
            (Direction::ToBroker, Method::ConfirmSelect { .. }) => {
                ch.next_seq.get_or_insert(1);
            }
            (
                Direction::ToClient,
                Method::BasicAck {
                    delivery_tag,
                    multiple,
                }
                | Method::BasicNack {
                    delivery_tag,
                    multiple,
                    ..
                },
            ) => {
                out.confirms = take_covered(&mut ch.unconfirmed, *delivery_tag, *multiple);
            }
            (
                Direction::ToClient,
                Method::BasicDeliver { delivery_tag, .. } | Method::BasicGetOk { delivery_tag, .. },
            ) => {
                ch.unsettled.insert(*delivery_tag, m.clone());
            }
            (
                Direction::ToBroker,
                Method::BasicAck {
                    delivery_tag,
                    multiple,
                }
                | Method::BasicNack {
                    delivery_tag,
                    multiple,
                    ..
                },
            ) => {
                out.settles = take_covered(&mut ch.unsettled, *delivery_tag, *multiple);
            }
            (Direction::ToBroker, Method::BasicReject { delivery_tag, .. }) => {
                out.settles = take_covered(&mut ch.unsettled, *delivery_tag, false);
            }
            _ => {}
        }
        let (class, method) = m.id();
        match dir {
            Direction::ToBroker => {
                let no_wait = matches!(
                    m,
                    Method::QueueDeclare { no_wait: true, .. }
                        | Method::ConfirmSelect { no_wait: true }
                );
                if !no_wait && reply_kinds(class, method).is_some() {
                    ch.pending.push_back(m.clone());
                }
            }
            Direction::ToClient => {
                if matches!(m, Method::ChannelClose { .. }) {
                    out.reply_to = ch.pending.pop_front();
                    ch.pending.clear();
                } else if let Some(i) = ch.pending.iter().position(|req| {
                    let (rc, rm) = req.id();
                    rc == class && reply_kinds(rc, rm).is_some_and(|k| k.contains(&method))
                }) {
                    out.reply_to = ch.pending.remove(i);
                }
            }
        }
        if matches!(m, Method::ChannelCloseOk | Method::ChannelClose { .. })
            && (dir == Direction::ToClient || matches!(m, Method::ChannelCloseOk))
        {
            // The channel is gone: a reopened one starts afresh.
            let pending = std::mem::take(&mut ch.pending);
            *ch = ChannelState {
                pending,
                ..Default::default()
            };
        }
        out
    }
}

/// A predicate on a [`Method`].
#[derive(Clone)]
pub struct Pred(Arc<dyn Fn(&Method) -> bool + Send + Sync>);

impl Pred {
    /// Holds for the methods `f` accepts.
    pub fn new(f: impl Fn(&Method) -> bool + Send + Sync + 'static) -> Self {
        Pred(Arc::new(f))
    }

    /// `basic.publish` to `exchange` with `routing_key`.
    pub fn publish(exchange: &str, routing_key: &str) -> Self {
        let (x, k) = (exchange.to_string(), routing_key.to_string());
        Pred::new(move |m| m.is_publish_to(&x, &k))
    }

    /// `basic.deliver` or `basic.get-ok` of a message published to
    /// `exchange` with `routing_key` (a lease copy: `""` and the lease
    /// queue's name).
    pub fn delivery(exchange: &str, routing_key: &str) -> Self {
        let (x, k) = (exchange.to_string(), routing_key.to_string());
        Pred::new(move |m| m.is_delivery_of(&x, &k))
    }

    /// `queue.declare` of `queue`, passive or not as `passive` says
    /// (`None`: either).
    pub fn queue_declare(queue: &str, passive: Option<bool>) -> Self {
        let q = queue.to_string();
        Pred::new(move |m| match m {
            Method::QueueDeclare {
                queue, passive: p, ..
            } => queue == &q && passive.is_none_or(|want| want == *p),
            _ => false,
        })
    }

    /// Whether `m` satisfies the predicate.
    pub fn test(&self, m: &Method) -> bool {
        (self.0)(m)
    }
}

impl fmt::Debug for Pred {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Pred(..)")
    }
}

/// What a rule watches for.
#[derive(Debug, Clone)]
pub enum Target {
    /// A method frame travelling `dir` that satisfies the predicate.
    Method(Direction, Pred),
    /// The broker's publisher confirm (`basic.ack`/`nack`) of a client
    /// `basic.publish` that satisfies the predicate (one match per such
    /// publish it covers).
    ConfirmOf(Pred),
    /// The client's `basic.ack` of a delivery (`basic.deliver` /
    /// `basic.get-ok`) that satisfies the predicate (one match per such
    /// delivery it covers; `nack` and `reject` do not match).
    AckOf(Pred),
    /// The broker's reply (or `channel.close`) to a client request that
    /// satisfies the predicate.
    ReplyTo(Pred),
}

/// When the connection is dropped relative to the matching frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Drop it without forwarding the frame: the receiver never sees it.
    CutBefore,
    /// Forward the frame, then drop: the receiver acts on it, the sender
    /// never sees the answer.
    CutAfter,
}

/// How both sockets of a cut connection are closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Close {
    /// Linger 0: a TCP RST to both sides.
    Reset,
    /// Shut down the write side (FIN) of both, then close.
    Fin,
}

/// How matches are counted for [`Rule::nth`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// Over every connection of the proxy.
    PerProxy,
    /// Separately for each connection (the first to reach `nth` fires).
    PerConnection,
}

/// Drop the connection at the `nth` match of `target` (see the module doc).
#[derive(Debug, Clone)]
pub struct Rule {
    /// What to match.
    pub target: Target,
    /// Which match fires (1 = the first).
    pub nth: usize,
    /// How matches are counted.
    pub count: Count,
    /// Before or after forwarding the matching frame.
    pub action: Action,
    /// RST or FIN.
    pub close: Close,
}

impl Rule {
    /// Cut before the 1st match of `target`, counted per proxy, with a RST.
    pub fn new(target: Target) -> Self {
        Rule {
            target,
            nth: 1,
            count: Count::PerProxy,
            action: Action::CutBefore,
            close: Close::Reset,
        }
    }

    /// Fire at the `n`th match (`n` ≥ 1; 0 is taken as 1).
    pub fn nth(mut self, n: usize) -> Self {
        self.nth = n.max(1);
        self
    }

    /// Count matches per connection.
    pub fn per_connection(mut self) -> Self {
        self.count = Count::PerConnection;
        self
    }

    /// Set the action.
    pub fn action(mut self, a: Action) -> Self {
        self.action = a;
        self
    }

    /// Set how the sockets are closed.
    pub fn close(mut self, c: Close) -> Self {
        self.close = c;
        self
    }

    /// How many matches frame `m` (with its `observed` effects) counts for.
    fn matches(&self, dir: Direction, m: &Method, observed: &Observed) -> usize {
        match &self.target {
            Target::Method(d, p) => usize::from(*d == dir && p.test(m)),
            Target::ConfirmOf(p) if dir == Direction::ToClient => {
                observed.confirms.iter().filter(|x| p.test(x)).count()
            }
            Target::AckOf(p)
                if dir == Direction::ToBroker && matches!(m, Method::BasicAck { .. }) =>
            {
                observed.settles.iter().filter(|x| p.test(x)).count()
            }
            Target::ReplyTo(p) if dir == Direction::ToClient => {
                usize::from(observed.reply_to.as_ref().is_some_and(|r| p.test(r)))
            }
            _ => 0,
        }
    }
}

/// Identifies a rule of one proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RuleId(usize);

/// A rule that fired.
#[derive(Debug, Clone)]
pub struct Fired {
    /// The connection it cut (numbered from 1 in accept order).
    pub connection: u64,
    /// The frame's channel.
    pub channel: u16,
    /// The frame's direction.
    pub direction: Direction,
    /// The matching method frame.
    pub method: Method,
    /// Whether the frame was forwarded before the cut.
    pub forwarded: bool,
    /// When.
    pub at: Instant,
}

#[derive(Debug)]
struct Slot {
    rule: Rule,
    armed: bool,
    total: usize,
    per_conn: HashMap<u64, usize>,
    fired: Option<Fired>,
}

/// The rules of a proxy and their counters. Pure (no I/O).
#[derive(Debug, Default)]
pub struct RuleSet {
    slots: Vec<Slot>,
}

impl RuleSet {
    /// Adds an armed rule.
    pub fn add(&mut self, rule: Rule) -> RuleId {
        self.slots.push(Slot {
            rule,
            armed: true,
            total: 0,
            per_conn: HashMap::new(),
            fired: None,
        });
        RuleId(self.slots.len() - 1)
    }

    /// Disarms rule `id` (it never fires afterwards).
    pub fn disarm(&mut self, id: RuleId) {
        if let Some(s) = self.slots.get_mut(id.0) {
            s.armed = false;
        }
    }

    /// Counts frame `m` of connection `conn` against every armed rule and
    /// returns the first rule that fires on it (it is disarmed).
    pub fn decide(
        &mut self,
        conn: u64,
        dir: Direction,
        channel: u16,
        m: &Method,
        observed: &Observed,
    ) -> Option<(RuleId, Action, Close)> {
        let mut hit = None;
        for (i, s) in self.slots.iter_mut().enumerate() {
            if !s.armed {
                continue;
            }
            let n = s.rule.matches(dir, m, observed);
            if n == 0 {
                continue;
            }
            s.total += n;
            let c = s.per_conn.entry(conn).or_default();
            *c += n;
            let count = match s.rule.count {
                Count::PerProxy => s.total,
                Count::PerConnection => *c,
            };
            if hit.is_none() && count >= s.rule.nth {
                s.armed = false;
                s.fired = Some(Fired {
                    connection: conn,
                    channel,
                    direction: dir,
                    method: m.clone(),
                    forwarded: s.rule.action == Action::CutAfter,
                    at: Instant::now(),
                });
                hit = Some((RuleId(i), s.rule.action, s.rule.close));
            }
        }
        hit
    }

    /// Matches of rule `id` so far (over the whole proxy).
    pub fn matches(&self, id: RuleId) -> usize {
        self.slots.get(id.0).map_or(0, |s| s.total)
    }

    /// Whether and where rule `id` fired.
    pub fn fired(&self, id: RuleId) -> Option<Fired> {
        self.slots.get(id.0).and_then(|s| s.fired.clone())
    }
}

#[derive(Debug)]
struct Shared {
    rules: Mutex<RuleSet>,
    /// Bumped whenever a rule fires.
    fires: watch::Sender<u64>,
    accepted: AtomicUsize,
    open: AtomicUsize,
    next_conn: AtomicU64,
    /// Connections whose stream stopped parsing as AMQP.
    unparsed: AtomicUsize,
}

impl Shared {
    fn rules(&self) -> std::sync::MutexGuard<'_, RuleSet> {
        self.rules.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An AMQP-aware TCP proxy from a local port to a broker (see the module
/// doc).
#[derive(Debug)]
pub struct AmqpProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl AmqpProxy {
    /// Listens on a free port of 127.0.0.1 and forwards every connection to
    /// the broker at `upstream`.
    ///
    /// # Errors
    /// If the listening socket cannot be bound.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            rules: Mutex::new(RuleSet::default()),
            fires: watch::channel(0).0,
            accepted: AtomicUsize::new(0),
            open: AtomicUsize::new(0),
            next_conn: AtomicU64::new(1),
            unparsed: AtomicUsize::new(0),
        });
        let stop = CancellationToken::new();
        let task = tokio::spawn(accept_loop(
            listener,
            upstream,
            shared.clone(),
            stop.clone(),
        ));
        Ok(AmqpProxy {
            addr,
            upstream,
            shared,
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

    /// `amqp://user:password@127.0.0.1:<port>/%2f`: the default vhost
    /// through this proxy.
    pub fn url(&self, user: &str, password: &str) -> String {
        format!("amqp://{user}:{password}@127.0.0.1:{}/%2f", self.port())
    }

    /// Arms `rule`.
    pub fn add_rule(&self, rule: Rule) -> RuleId {
        self.shared.rules().add(rule)
    }

    /// Disarms rule `id` (its counters and firing record stay readable).
    pub fn disarm(&self, id: RuleId) {
        self.shared.rules().disarm(id);
    }

    /// Matches of rule `id` so far.
    pub fn matches(&self, id: RuleId) -> usize {
        self.shared.rules().matches(id)
    }

    /// Whether and where rule `id` fired.
    pub fn fired(&self, id: RuleId) -> Option<Fired> {
        self.shared.rules().fired(id)
    }

    /// Waits up to `timeout` for rule `id` to fire.
    pub async fn wait_fired(&self, id: RuleId, timeout: Duration) -> Option<Fired> {
        let mut rx = self.shared.fires.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(f) = self.fired(id) {
                return Some(f);
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return self.fired(id),
            }
        }
    }

    /// Connections accepted since the start.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        self.shared.open.load(Ordering::SeqCst)
    }

    /// Connections whose bytes stopped parsing as AMQP (then forwarded
    /// unparsed, with no rule applied); 0 unless something is wrong.
    pub fn unparsed_connections(&self) -> usize {
        self.shared.unparsed.load(Ordering::SeqCst)
    }
}

impl Drop for AmqpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.task.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.cancelled() => return,
        };
        let Ok((client, _)) = accepted else {
            // EMFILE and the like: do not spin.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        shared.open.fetch_add(1, Ordering::SeqCst);
        let id = shared.next_conn.fetch_add(1, Ordering::SeqCst);
        let sh = shared.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = connection(id, client, upstream, &sh) => {}
                _ = stop.cancelled() => {}
            }
            sh.open.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

/// What to do with the bytes read in one direction.
struct Step {
    forward: Vec<u8>,
    cut: Option<Close>,
}

/// One direction's parser; `raw` once it stopped parsing.
struct Side {
    reader: FrameReader,
    raw: bool,
}

fn step(
    side: &mut Side,
    dir: Direction,
    conn: u64,
    tracker: &mut Tracker,
    shared: &Shared,
) -> Step {
    let mut out = Step {
        forward: Vec::new(),
        cut: None,
    };
    if side.raw {
        out.forward = side.reader.take_pending();
        return out;
    }
    loop {
        let frame = match side.reader.next_frame() {
            Ok(Some(f)) => f,
            Ok(None) => return out,
            Err(_) => {
                shared.unparsed.fetch_add(1, Ordering::SeqCst);
                side.raw = true;
                out.forward.extend(side.reader.take_pending());
                return out;
            }
        };
        let start = side.reader.pos - frame.wire_len;
        let bytes = &side.reader.buf[start..side.reader.pos];
        if frame.kind == FRAME_METHOD {
            let Ok(m) = parse_method(&frame.payload) else {
                shared.unparsed.fetch_add(1, Ordering::SeqCst);
                side.raw = true;
                out.forward.extend_from_slice(bytes);
                out.forward.extend(side.reader.take_pending());
                return out;
            };
            let observed = tracker.observe(dir, frame.channel, &m);
            let hit = shared
                .rules()
                .decide(conn, dir, frame.channel, &m, &observed);
            if let Some((_, action, close)) = hit {
                if action == Action::CutAfter {
                    out.forward.extend_from_slice(bytes);
                }
                out.cut = Some(close);
                shared.fires.send_modify(|n| *n += 1);
                return out;
            }
        }
        out.forward.extend_from_slice(bytes);
    }
}

/// Closes both sockets as `close` says.
async fn cut(mut client: TcpStream, mut server: TcpStream, close: Close) {
    match close {
        Close::Reset => {
            let _ = client.set_zero_linger();
            let _ = server.set_zero_linger();
        }
        Close::Fin => {
            let _ = tokio::join!(client.shutdown(), server.shutdown());
        }
    }
    drop(client);
    drop(server);
}

/// Forwards one connection, applying the rules, until both sides closed or
/// a rule cut it.
async fn connection(conn: u64, mut client: TcpStream, upstream: SocketAddr, shared: &Shared) {
    let _ = client.set_nodelay(true);
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return; // the client sees its connection closed, as when refused
    };
    let _ = server.set_nodelay(true);
    let mut tracker = Tracker::default();
    let mut up = Side {
        reader: FrameReader::client(),
        raw: false,
    };
    let mut down = Side {
        reader: FrameReader::broker(),
        raw: false,
    };
    let mut cbuf = vec![0u8; 64 * 1024];
    let mut sbuf = vec![0u8; 64 * 1024];
    let (mut client_eof, mut server_eof) = (false, false);
    while !(client_eof && server_eof) {
        let (dir, n) = tokio::select! {
            r = client.read(&mut cbuf), if !client_eof => (Direction::ToBroker, r),
            r = server.read(&mut sbuf), if !server_eof => (Direction::ToClient, r),
        };
        let n = match n {
            Ok(0) => {
                // EOF: pass the half-close on.
                if dir == Direction::ToBroker {
                    client_eof = true;
                    let _ = server.shutdown().await;
                } else {
                    server_eof = true;
                    let _ = client.shutdown().await;
                }
                continue;
            }
            Err(_) => return,
            Ok(n) => n,
        };
        let (side, data, to) = match dir {
            Direction::ToBroker => (&mut up, &cbuf[..n], &mut server),
            Direction::ToClient => (&mut down, &sbuf[..n], &mut client),
        };
        side.reader.push(data);
        let s = step(side, dir, conn, &mut tracker, shared);
        if !s.forward.is_empty() && to.write_all(&s.forward).await.is_err() {
            return;
        }
        if let Some(close) = s.cut {
            cut(client, server, close).await;
            return;
        }
    }
}

/// Encoders for building frames in tests (of this module and others).
pub mod encode {
    use super::{FRAME_END, FRAME_METHOD};

    /// A frame of `kind` on `channel` with `payload`.
    pub fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![kind];
        f.extend_from_slice(&channel.to_be_bytes());
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        f.extend_from_slice(payload);
        f.push(FRAME_END);
        f
    }

    /// A method frame: class and method ids, then the encoded `args`.
    pub fn method(channel: u16, class: u16, method: u16, args: &[u8]) -> Vec<u8> {
        let mut p = class.to_be_bytes().to_vec();
        p.extend_from_slice(&method.to_be_bytes());
        p.extend_from_slice(args);
        frame(FRAME_METHOD, channel, &p)
    }

    /// A short string (length octet, bytes).
    pub fn shortstr(s: &str) -> Vec<u8> {
        let mut v = vec![s.len() as u8];
        v.extend_from_slice(s.as_bytes());
        v
    }

    /// `basic.publish` to `exchange` with `key`.
    pub fn publish(channel: u16, exchange: &str, key: &str) -> Vec<u8> {
        let mut a = vec![0, 0];
        a.extend(shortstr(exchange));
        a.extend(shortstr(key));
        a.push(0);
        method(channel, 60, 40, &a)
    }

    /// `basic.deliver` with `tag` of a message published to `exchange`
    /// with `key`.
    pub fn deliver(channel: u16, tag: u64, exchange: &str, key: &str) -> Vec<u8> {
        let mut a = shortstr("ctag");
        a.extend_from_slice(&tag.to_be_bytes());
        a.push(0);
        a.extend(shortstr(exchange));
        a.extend(shortstr(key));
        method(channel, 60, 60, &a)
    }

    /// `basic.get-ok` with `tag` of a message published to `exchange` with
    /// `key`.
    pub fn get_ok(channel: u16, tag: u64, exchange: &str, key: &str) -> Vec<u8> {
        let mut a = tag.to_be_bytes().to_vec();
        a.push(0);
        a.extend(shortstr(exchange));
        a.extend(shortstr(key));
        a.extend_from_slice(&0u32.to_be_bytes());
        method(channel, 60, 71, &a)
    }

    /// `basic.ack` (a client's ack or a broker's confirm).
    pub fn ack(channel: u16, tag: u64, multiple: bool) -> Vec<u8> {
        let mut a = tag.to_be_bytes().to_vec();
        a.push(u8::from(multiple));
        method(channel, 60, 80, &a)
    }

    /// `basic.nack`.
    pub fn nack(channel: u16, tag: u64, multiple: bool, requeue: bool) -> Vec<u8> {
        let mut a = tag.to_be_bytes().to_vec();
        a.push(u8::from(multiple) | (u8::from(requeue) << 1));
        method(channel, 60, 120, &a)
    }

    /// `queue.declare` of `queue`.
    pub fn queue_declare(channel: u16, queue: &str, passive: bool) -> Vec<u8> {
        let mut a = vec![0, 0];
        a.extend(shortstr(queue));
        a.push(u8::from(passive));
        a.extend_from_slice(&0u32.to_be_bytes()); // empty arguments table
        method(channel, 50, 10, &a)
    }

    /// `queue.declare-ok` of `queue`.
    pub fn queue_declare_ok(channel: u16, queue: &str) -> Vec<u8> {
        let mut a = shortstr(queue);
        a.extend_from_slice(&[0; 8]);
        method(channel, 50, 11, &a)
    }

    /// `confirm.select`.
    pub fn confirm_select(channel: u16) -> Vec<u8> {
        method(channel, 85, 10, &[0])
    }
}

#[cfg(test)]
mod tests {
    use super::encode as e;
    use super::*;

    fn frames(r: &mut FrameReader) -> Vec<Frame> {
        let mut v = Vec::new();
        while let Some(f) = r.next_frame().unwrap() {
            v.push(f);
        }
        v
    }

    fn method_of(bytes: &[u8]) -> Method {
        let mut r = FrameReader::broker();
        r.push(bytes);
        parse_method(&r.next_frame().unwrap().unwrap().payload).unwrap()
    }

    #[test]
    fn the_parser_splits_a_stream_fed_byte_by_byte_into_its_frames() {
        let mut stream = PROTOCOL_HEADER.to_vec();
        stream.extend(e::publish(1, "x", "k"));
        stream.extend(e::frame(FRAME_HEADER, 1, &[0; 14]));
        stream.extend(e::frame(FRAME_BODY, 1, b"hello"));
        stream.extend(e::frame(FRAME_HEARTBEAT, 0, &[]));
        let mut r = FrameReader::client();
        let mut got = Vec::new();
        for b in &stream {
            r.push(std::slice::from_ref(b));
            got.extend(frames(&mut r));
        }
        let kinds: Vec<(u8, u16)> = got.iter().map(|f| (f.kind, f.channel)).collect();
        assert_eq!(
            kinds,
            [
                (0, 0),
                (FRAME_METHOD, 1),
                (FRAME_HEADER, 1),
                (FRAME_BODY, 1),
                (FRAME_HEARTBEAT, 0)
            ]
        );
        assert_eq!(got.iter().map(|f| f.wire_len).sum::<usize>(), stream.len());
        assert_eq!(got[3].payload, b"hello");
        assert!(r.pending().is_empty());
    }

    #[test]
    fn the_parser_refuses_a_bad_header_and_a_bad_frame_end() {
        let mut r = FrameReader::client();
        r.push(b"HTTP/1.1 ");
        assert!(matches!(r.next_frame(), Err(FrameError::BadHeader(_))));
        let mut r = FrameReader::broker();
        let mut f = e::ack(1, 1, false);
        *f.last_mut().unwrap() = 0;
        r.push(&f);
        assert_eq!(r.next_frame(), Err(FrameError::BadFrameEnd(0)));
    }

    #[test]
    fn method_arguments_are_decoded() {
        assert_eq!(
            method_of(&e::publish(3, "vq.events", "job.p.finished")),
            Method::BasicPublish {
                exchange: "vq.events".into(),
                routing_key: "job.p.finished".into(),
                mandatory: false
            }
        );
        assert_eq!(
            method_of(&e::deliver(1, 7, "c.jobs", "p")),
            Method::BasicDeliver {
                consumer_tag: "ctag".into(),
                delivery_tag: 7,
                redelivered: false,
                exchange: "c.jobs".into(),
                routing_key: "p".into()
            }
        );
        assert!(method_of(&e::get_ok(2, 9, "", "c.lease.a")).is_delivery_of("", "c.lease.a"));
        assert_eq!(
            method_of(&e::queue_declare(1, "c.pool.p", true)),
            Method::QueueDeclare {
                queue: "c.pool.p".into(),
                passive: true,
                no_wait: false
            }
        );
        assert_eq!(
            method_of(&e::nack(1, 4, true, true)),
            Method::BasicNack {
                delivery_tag: 4,
                multiple: true,
                requeue: true
            }
        );
        assert_eq!(
            method_of(&e::method(1, 60, 20, &[])),
            Method::Other {
                class: 60,
                method: 20
            }
        );
        let mut r = FrameReader::broker();
        r.push(&e::method(1, 60, 80, &[0, 0]));
        let f = r.next_frame().unwrap().unwrap();
        assert!(parse_method(&f.payload).is_err());
    }

    fn observe(t: &mut Tracker, dir: Direction, bytes: &[u8]) -> Observed {
        let mut r = FrameReader::broker();
        r.push(bytes);
        let f = r.next_frame().unwrap().unwrap();
        t.observe(dir, f.channel, &parse_method(&f.payload).unwrap())
    }

    fn keys(ms: &[Method]) -> Vec<&str> {
        ms.iter()
            .filter_map(|m| m.exchange_and_key().map(|(_, k)| k))
            .collect()
    }

    #[test]
    fn a_confirm_maps_back_to_the_publishes_it_covers() {
        use Direction::{ToBroker as Up, ToClient as Down};
        let mut t = Tracker::default();
        // No confirm mode: nothing tracked.
        observe(&mut t, Up, &e::publish(1, "x", "before-select"));
        observe(&mut t, Up, &e::confirm_select(1));
        for k in ["a", "b", "c", "d"] {
            observe(&mut t, Up, &e::publish(1, "x", k));
        }
        observe(&mut t, Up, &e::publish(2, "x", "other-channel"));
        assert_eq!(
            keys(&observe(&mut t, Down, &e::ack(1, 2, false)).confirms),
            ["b"]
        );
        assert_eq!(
            keys(&observe(&mut t, Down, &e::ack(1, 3, true)).confirms),
            ["a", "c"]
        );
        assert_eq!(
            keys(&observe(&mut t, Down, &e::nack(1, 4, false, false)).confirms),
            ["d"]
        );
        assert!(observe(&mut t, Down, &e::ack(1, 4, false))
            .confirms
            .is_empty());
        // A channel reopened after close-ok starts its numbering afresh.
        observe(&mut t, Up, &e::method(1, 20, 40, &[0, 200, 0, 0, 0, 0, 0]));
        observe(&mut t, Down, &e::method(1, 20, 41, &[]));
        observe(&mut t, Up, &e::method(1, 20, 10, &[0]));
        observe(&mut t, Up, &e::confirm_select(1));
        observe(&mut t, Up, &e::publish(1, "x", "fresh"));
        assert_eq!(
            keys(&observe(&mut t, Down, &e::ack(1, 1, false)).confirms),
            ["fresh"]
        );
    }

    #[test]
    fn a_client_ack_maps_back_to_the_deliveries_it_settles() {
        use Direction::{ToBroker as Up, ToClient as Down};
        let mut t = Tracker::default();
        observe(&mut t, Down, &e::deliver(1, 1, "c.jobs", "p1"));
        observe(&mut t, Down, &e::deliver(1, 2, "c.jobs", "p2"));
        observe(&mut t, Down, &e::get_ok(1, 3, "", "lease"));
        observe(&mut t, Down, &e::deliver(1, 4, "c.jobs", "p4"));
        assert_eq!(
            keys(&observe(&mut t, Up, &e::ack(1, 3, false)).settles),
            ["lease"]
        );
        assert_eq!(
            keys(&observe(&mut t, Up, &e::nack(1, 2, true, true)).settles),
            ["p1", "p2"]
        );
        // multiple with tag 0: everything outstanding.
        assert_eq!(
            keys(&observe(&mut t, Up, &e::ack(1, 0, true)).settles),
            ["p4"]
        );
        // A broker ack on a channel without confirm mode settles nothing.
        assert!(observe(&mut t, Down, &e::ack(1, 1, false))
            .confirms
            .is_empty());
    }

    #[test]
    fn a_reply_maps_back_to_its_request() {
        use Direction::{ToBroker as Up, ToClient as Down};
        let mut t = Tracker::default();
        observe(&mut t, Up, &e::queue_declare(1, "q1", true));
        observe(&mut t, Up, &e::method(1, 60, 70, &[0, 0, 1, b'g', 0]));
        let r = observe(&mut t, Down, &e::queue_declare_ok(1, "q1")).reply_to;
        assert!(matches!(r, Some(Method::QueueDeclare { queue, .. }) if queue == "q1"));
        let r = observe(&mut t, Down, &e::method(1, 60, 72, &[0])).reply_to;
        assert!(matches!(r, Some(Method::BasicGet { queue, .. }) if queue == "g"));
        observe(&mut t, Up, &e::queue_declare(1, "missing", true));
        let close = e::method(1, 20, 40, &[1, 148, 0, 0, 50, 0, 10]);
        let r = observe(&mut t, Down, &close).reply_to;
        assert!(matches!(r, Some(Method::QueueDeclare { queue, .. }) if queue == "missing"));
    }

    #[test]
    fn a_rule_fires_once_at_its_nth_match_counted_per_proxy_or_per_connection() {
        let m = Method::BasicPublish {
            exchange: "x".into(),
            routing_key: "k".into(),
            mandatory: false,
        };
        let none = Observed::default();
        let mut rs = RuleSet::default();
        let target = Target::Method(Direction::ToBroker, Pred::publish("x", "k"));
        let proxy = rs.add(Rule::new(target.clone()).nth(3));
        let per_conn = rs.add(
            Rule::new(target)
                .nth(2)
                .per_connection()
                .action(Action::CutAfter),
        );
        let up = Direction::ToBroker;
        assert!(rs.decide(1, up, 1, &m, &none).is_none());
        assert!(rs.decide(2, up, 1, &m, &none).is_none());
        // The proxy-wide count reaches 3 first (the earlier rule wins).
        assert_eq!(
            rs.decide(2, up, 1, &m, &none),
            Some((proxy, Action::CutBefore, Close::Reset))
        );
        assert!(rs.fired(proxy).is_some_and(|f| f.connection == 2));
        assert!(rs.decide(3, up, 1, &m, &none).is_none());
        assert_eq!(
            rs.decide(3, up, 1, &m, &none),
            Some((per_conn, Action::CutAfter, Close::Reset))
        );
        assert!(rs.decide(3, up, 1, &m, &none).is_none());
        // The other direction never matches.
        let mut rs = RuleSet::default();
        rs.add(Rule::new(Target::Method(
            Direction::ToClient,
            Pred::publish("x", "k"),
        )));
        assert!(rs.decide(1, up, 1, &m, &none).is_none());
    }

    #[test]
    fn a_confirm_rule_counts_the_matching_publishes_an_ack_covers() {
        let ack = Method::BasicAck {
            delivery_tag: 5,
            multiple: true,
        };
        let p = |k: &str| Method::BasicPublish {
            exchange: "".into(),
            routing_key: k.into(),
            mandatory: true,
        };
        let mut rs = RuleSet::default();
        let id = rs.add(Rule::new(Target::ConfirmOf(Pred::publish("", "lease"))).nth(2));
        let obs = Observed {
            confirms: vec![p("lease"), p("other")],
            ..Default::default()
        };
        assert!(rs.decide(1, Direction::ToClient, 1, &ack, &obs).is_none());
        // The same ack seen going up (a client ack) is no confirm.
        assert!(rs.decide(1, Direction::ToBroker, 1, &ack, &obs).is_none());
        assert!(rs
            .decide(1, Direction::ToClient, 1, &ack, &obs)
            .is_some_and(|(i, _, _)| i == id));
    }
}
