//! The person at the terminal: who invoked `vq` (the job owner, and whose
//! jobs `stat` and `cancel` act on), and text made safe to print to them.

use crate::error::CliError;

/// The invoking Unix user, from the password database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvokingUser {
    /// User name (the owner of the jobs this user submits).
    pub name: String,
    /// Home directory.
    pub home: String,
    /// Login shell (a job's default shell).
    pub shell: String,
    /// Whether the uid is 0 (root may cancel and show every job).
    pub is_root: bool,
}

/// The invoking Unix user (the real uid's password entry).
///
/// # Errors
/// [`CliError::Environment`] if the lookup fails or the uid has no entry.
pub fn invoking_user() -> Result<InvokingUser, CliError> {
    let uid = nix::unistd::getuid();
    let user = nix::unistd::User::from_uid(uid)
        .map_err(|e| CliError::Environment {
            what: format!("user name of uid {uid}"),
            source: Some(Box::new(e)),
        })?
        .ok_or_else(|| CliError::Environment {
            what: format!("user name of uid {uid} (not in the password database)"),
            source: None,
        })?;
    Ok(InvokingUser {
        name: user.name,
        home: user.dir.to_string_lossy().into_owned(),
        shell: user.shell.to_string_lossy().into_owned(),
        is_root: uid.is_root(),
    })
}

/// `text` made safe for a terminal: control characters (escape sequences,
/// NUL, newlines) and bidirectional overrides
/// ([`vq_common::text::must_escape`]) are shown as `\u{..}` escapes. Job ids, names and owners
/// come from other users' messages; printing them raw would let one user
/// drive another's (or root's) terminal.
pub fn printable(text: &str) -> String {
    if !text.chars().any(vq_common::text::must_escape) {
        return text.to_string();
    }
    text.chars()
        .map(|c| {
            if vq_common::text::must_escape(c) {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// [`printable`] applied to each line of `table`, keeping the line breaks.
pub fn printable_lines(table: &str) -> String {
    table
        .split_inclusive('\n')
        .map(|line| match line.strip_suffix('\n') {
            Some(l) => printable(l) + "\n",
            None => printable(line),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_for_the_terminal() {
        assert_eq!(printable("plain-name_1.x"), "plain-name_1.x");
        assert_eq!(printable("a\u{1b}[2Jb\n"), "a\\u{1b}[2Jb\\u{a}");
        assert_eq!(printable("vq-\u{202e}1-sm"), "vq-\\u{202e}1-sm");
    }

    #[test]
    fn tables_keep_their_line_breaks_but_not_escapes_inside_a_line() {
        assert_eq!(
            printable_lines("a\tb\nc\u{7}\nlast"),
            "a\\u{9}b\nc\\u{7}\nlast"
        );
        assert_eq!(printable_lines("x\n"), "x\n");
    }
}
