//! Reading and setting the headers of a message's properties.

use lapin::types::AMQPValue;
use lapin::BasicProperties;

/// The number in header `name` of `props` (any AMQP integer type, or a
/// decimal string; absent, negative or not a number gives 0, too large
/// gives `u32::MAX`). Used for loss counters (`x-vq-losses`).
pub fn header_u32(props: &BasicProperties, name: &str) -> u32 {
    let Some(v) = props.headers().as_ref().and_then(|h| h.inner().get(name)) else {
        return 0;
    };
    let n: i128 = match v {
        AMQPValue::ShortShortInt(n) => i128::from(*n),
        AMQPValue::ShortShortUInt(n) => i128::from(*n),
        AMQPValue::ShortInt(n) => i128::from(*n),
        AMQPValue::ShortUInt(n) => i128::from(*n),
        AMQPValue::LongInt(n) => i128::from(*n),
        AMQPValue::LongUInt(n) => i128::from(*n),
        AMQPValue::LongLongInt(n) => i128::from(*n),
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes())
            .trim()
            .parse()
            .unwrap_or(0),
        _ => 0,
    };
    u32::try_from(n.max(0)).unwrap_or(u32::MAX)
}

/// The string in header `name` of `props` (long or short string), if any.
pub fn header_str(props: &BasicProperties, name: &str) -> Option<String> {
    match props.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

/// `props` with header `name` set to the integer `value`.
pub fn with_header_u32(props: BasicProperties, name: &str, value: u32) -> BasicProperties {
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(name.into(), AMQPValue::LongLongInt(i64::from(value)));
    props.with_headers(headers)
}

/// `props` with string header `name` set to `value` (replacing any).
pub fn with_header_str(props: BasicProperties, name: &str, value: &str) -> BasicProperties {
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(name.into(), AMQPValue::LongString(value.into()));
    props.with_headers(headers)
}
