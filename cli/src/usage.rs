//! Usage errors in words: what `vq` prints when clap refuses the command
//! line with an unknown option.
//!
//! clap's own text for an unknown option ends with "tip: to pass '-I' as a
//! value, use '-- -I'", which for `vq submit -I job.sh` points to a wrong
//! usage (`vq submit -- -I` would take `-I` for the script's name). For
//! `qsub` options that vq knows but does not run (interactive jobs, arrays,
//! holds, …; Torque 6 `qsub(1)`, PBS Pro `qsub`) it says why; for any other
//! unknown option it says so, keeps clap's "a similar argument exists"
//! suggestion and the usage line, and points to `--help`.

use clap::error::{ContextKind, ContextValue, ErrorKind};

/// `qsub` options vq does not support, with the reason given to the user.
/// The letters are Torque's (and PBS Pro's where they agree).
pub const UNSUPPORTED_QSUB_OPTIONS: &[(&str, &str)] = &[
    (
        "-I",
        "interactive jobs are not supported: vq runs batch scripts; submit a script",
    ),
    (
        "-X",
        "X11 forwarding needs an interactive job, which vq does not run",
    ),
    (
        "-t",
        "job arrays are not supported yet: submit one job per index",
    ),
    (
        "-J",
        "job arrays are not supported yet: submit one job per index",
    ),
    ("-a", "deferred start times are not supported"),
    ("-p", "job priorities are not supported"),
    ("-c", "checkpointing is not supported"),
    (
        "-k",
        "keeping output on the execution host is not supported: vq writes -o/-e where you name them",
    ),
    ("-F", "arguments to the job script are not supported"),
    ("-P", "proxy users are not supported: a job runs as its submitter"),
    ("-C", "another directive prefix than #PBS is not supported"),
    ("-x", "running the script in place is not supported"),
];

/// The text `vq` prints for a clap error of kind
/// [`ErrorKind::UnknownArgument`] (an option the command does not take),
/// without clap's "use '-- -X'" tip; `None` for every other kind (clap's
/// own rendering is right for them).
pub fn unknown_option_text(err: &clap::Error) -> Option<String> {
    if err.kind() != ErrorKind::UnknownArgument {
        return None;
    }
    let arg = match err.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(s)) => s.clone(),
        _ => return None,
    };
    let usage = match err.get(ContextKind::Usage) {
        Some(ContextValue::StyledStr(s)) => s.to_string(),
        _ => String::new(),
    };
    let usage = usage.trim();
    // "Usage: vq submit [OPTIONS] <SCRIPT>" → "vq submit".
    let command: String = usage
        .trim_start_matches("Usage:")
        .split_whitespace()
        .take_while(|w| !w.starts_with('[') && !w.starts_with('<'))
        .collect::<Vec<_>>()
        .join(" ");
    let command = if command.is_empty() {
        "vq".to_string()
    } else {
        command
    };
    // `-I`, `-Ifoo`, `-t=1-3`: the option letter decides.
    let letter: String = arg.chars().take(2).collect();
    let mut text = format!("{command}: unknown option '{arg}'");
    if command == "vq submit" {
        if let Some((_, why)) = UNSUPPORTED_QSUB_OPTIONS.iter().find(|(o, _)| *o == letter) {
            text.push_str(&format!(" ({why})"));
        }
    }
    text.push('\n');
    if let Some(ContextValue::String(similar)) = err.get(ContextKind::SuggestedArg) {
        text.push_str(&format!("  a similar option exists: '{similar}'\n"));
    }
    if !usage.is_empty() {
        text.push('\n');
        text.push_str(usage);
        text.push('\n');
    }
    text.push_str(&format!(
        "\nFor more information, try '{command} --help'.\n"
    ));
    Some(text)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::Cli;

    fn text(args: &[&str]) -> String {
        let err = Cli::try_parse_from(args).unwrap_err();
        unknown_option_text(&err).unwrap_or_else(|| panic!("no text for {args:?}: {err}"))
    }

    #[test]
    fn known_qsub_options_say_why_and_never_suggest_a_double_dash() {
        let t = text(&["vq", "submit", "-I", "job.sh"]);
        assert!(
            t.starts_with("vq submit: unknown option '-I' (interactive jobs are not supported"),
            "{t}"
        );
        assert!(!t.contains("'--"), "{t}");
        assert!(t.contains("Usage: vq submit"), "{t}");
        assert!(t.contains("try 'vq submit --help'"), "{t}");
        let t = text(&["vq", "submit", "-t", "1-10", "job.sh"]);
        assert!(t.contains("job arrays are not supported yet"), "{t}");
    }

    #[test]
    fn other_unknown_options_keep_the_usage_and_similar_suggestions() {
        let t = text(&["vq", "stat", "-x"]);
        assert!(t.starts_with("vq stat: unknown option '-x'\n"), "{t}");
        assert!(!t.contains("-- -x"), "{t}");
        assert!(t.contains("Usage: vq stat"), "{t}");
        let t = text(&["vq", "submit", "--wiat", "job.sh"]);
        assert!(t.contains("a similar option exists: '--wait'"), "{t}");
        // Other errors keep clap's rendering.
        let err = Cli::try_parse_from(["vq", "submit"]).unwrap_err();
        assert!(unknown_option_text(&err).is_none());
    }
}
