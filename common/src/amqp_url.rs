//! The one reading of a broker URL (`amqp://user:password@host:port/vhost`
//! or `amqps://…`), on lapin's own parser (`amq-protocol-uri`'s
//! [`AMQPUri`]), so the user the daemons log in as, the `user_id` they
//! stamp on messages and the user shown in logs never differ. Re-exported
//! by [`crate::amqp`] and used by [`crate::config::redact_url`].

pub use amq_protocol_uri::AMQPUri;

/// RabbitMQ's default user, which lapin logs in as when a URL names none.
pub const DEFAULT_USER: &str = "guest";

/// Parses `url` exactly as lapin does when connecting.
///
/// # Errors
/// lapin's message when `url` is not a valid AMQP URI.
pub fn parse_url(url: &str) -> Result<AMQPUri, String> {
    url.parse::<AMQPUri>()
}

/// The user a connection to `url` logs in as (percent-decoded):
/// [`DEFAULT_USER`] (`guest`) when the URL names none, as for lapin and
/// RabbitMQ. It is also the AMQP `user_id` vq stamps on what that
/// connection publishes (control messages, requeued jobs, submitted jobs),
/// which RabbitMQ checks against the logged-in user. A URL that cannot be
/// parsed gives `guest` too (connecting with it fails anyway).
pub fn broker_user(url: &str) -> String {
    parse_url(url)
        .map(|u| u.authority.userinfo.username)
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| DEFAULT_USER.to_string())
}

/// `url` with its password replaced by `***`, for logs and errors; the
/// user is shown as written. Works on URLs that do not parse (those appear
/// in configuration errors): the authority is the text between `://` and
/// the first `/` or `?`, its user information what precedes its last `@`.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_without_a_user_logs_in_and_publishes_as_guest() {
        assert_eq!(broker_user("amqp://host/%2f"), "guest");
        assert_eq!(broker_user("amqp://vq%2Dctl:pw@h:5672/%2f"), "vq-ctl");
        assert_eq!(broker_user("amqps://ctl@h/%2f"), "ctl");
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("amqp://agent:s3cret@h:5672/%2f"),
            "amqp://agent:***@h:5672/%2f"
        );
        assert_eq!(
            redact_url("amqp://a:p@ss@h/v?x=a@b"),
            "amqp://a:***@h/v?x=a@b"
        );
        assert_eq!(redact_url("amqp://h:5672"), "amqp://h:5672");
    }
}
