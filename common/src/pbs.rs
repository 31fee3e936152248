//! `#PBS` directive and walltime parsing, with Torque's semantics, so that
//! existing Torque/PBS job scripts run unchanged under `vq submit`.
//!
//! Pure: no I/O. Values that depend on the submit host (relative paths, `-v
//! VAR` without a value) are returned as written and resolved by the CLI.
//!
//! Sources for the rules below: Torque 6 `qsub(1)` manual ("Script
//! Processing", the option list and "Extended description"), and
//! `pbs_resources(7)` for the `walltime` time format. Where Torque is
//! ambiguous or vq cannot honour an option, the choice is documented on the
//! item.
//!
//! Directive scanning (Torque `qsub`, "Script Processing"): directives are
//! lines starting with `#PBS` (leading blanks allowed) in the leading block
//! of comment and blank lines; scanning stops at the first line that is
//! neither blank nor a comment. `#PBS` lines after that point are ignored
//! (with a warning, since that is usually a mistake). Options are tokenised
//! like a shell does (single and double quotes, backslash escapes); an
//! unquoted word starting with `#` starts a trailing comment.

use std::fmt;

use crate::messages::{DependKind, Dependency, Join, MAX_JOB_ID_BYTES};
use crate::topology::valid_name;

/// Longest accepted job name, in characters. Torque's server limit
/// `PBS_MAXJOBNAME` is 236 (older PBS allowed 15; POSIX qsub says
/// "at least 15").
pub const MAX_JOB_NAME_LEN: usize = 236;

/// Largest accepted walltime, seconds (100 years): larger values are
/// certainly typos, and keeping them bounded keeps all arithmetic on them
/// overflow-free.
pub const MAX_WALLTIME_SECS: u64 = 100 * 365 * 24 * 3600;

/// Largest accepted slot request (`ppn`, `ncpus`): larger values are typos
/// (no VM flavor has more cores).
pub const MAX_SLOTS: u32 = 4096;

/// Bytes in a word of Torque's `size` format (`w`, `kw`, …): the execution
/// host's word size, 8 bytes on the 64-bit hosts vq runs on.
pub const WORD_BYTES: u64 = 8;

/// A problem in a walltime, a directive or a command-line option.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PbsError {
    /// A `-l walltime=` value is not `[[[D:]HH:]MM:]SS[.frac]`.
    #[error("invalid walltime {value:?}: {reason}")]
    Walltime {
        /// The value as written.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An option that vq (like Torque) does not know, or cannot honour.
    #[error("unsupported option -{option}")]
    UnknownOption {
        /// The option letter (or text) as written, without the dash.
        option: String,
    },
    /// An option that takes a value has none.
    #[error("option -{option} needs a value")]
    MissingValue {
        /// The option letter.
        option: char,
    },
    /// An option's value is invalid.
    #[error("invalid value {value:?} for option -{option}: {reason}")]
    InvalidValue {
        /// The option letter.
        option: char,
        /// The value as written.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A word that is not an option where an option was expected.
    #[error("unexpected argument {word:?} (expected an option such as -N)")]
    UnexpectedArgument {
        /// The word.
        word: String,
    },
    /// A `-l` resource request vq cannot honour or parse (`nodes=2`, a
    /// multi-chunk `select`, a bad size).
    #[error("invalid resource request {value:?}: {reason}")]
    Resource {
        /// The resource as written, e.g. `nodes=2:ppn=4`.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A quote is not closed before the end of the line.
    #[error("unterminated {quote} quote")]
    UnterminatedQuote {
        /// `'` or `"`.
        quote: char,
    },
    /// A problem on one line of a script.
    #[error("#PBS directive on line {line}")]
    AtLine {
        /// 1-based line number in the script.
        line: usize,
        /// The problem.
        #[source]
        source: Box<PbsError>,
    },
}

impl PbsError {
    fn at_line(self, line: usize) -> PbsError {
        PbsError::AtLine {
            line,
            source: Box::new(self),
        }
    }

    /// The script line the error is on, if it came from a script.
    pub fn line(&self) -> Option<usize> {
        match self {
            PbsError::AtLine { line, .. } => Some(*line),
            _ => None,
        }
    }

    fn invalid(option: char, value: &str, reason: impl Into<String>) -> PbsError {
        PbsError::InvalidValue {
            option,
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

/// Something accepted but not (fully) honoured, e.g. `-m` mail options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    /// 1-based script line, `None` for a command-line option.
    pub line: Option<usize>,
    /// What was ignored and why.
    pub message: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "line {line}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// Value of a `-v` variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VarValue {
    /// `-v VAR=value`.
    Given(String),
    /// `-v VAR`: take the value from the submit environment (resolved by the
    /// CLI; a variable unset there is exported empty, as Torque does).
    FromEnvironment,
}

/// A `-l` resource vq keeps but does not enforce (e.g. `nodes=1:ppn=4`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    /// Resource name, e.g. `nodes`.
    pub name: String,
    /// Value as written (may be empty for a bare name).
    pub value: String,
}

/// Job attributes from `#PBS` directives or `qsub`-style command-line
/// options. `None` (or empty) means "not given": the CLI applies defaults.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Directives {
    /// `-N`: job name (validated with [`validate_job_name`]).
    pub name: Option<String>,
    /// `-q`: pool (queue); a `queue@server` destination keeps the queue.
    pub queue: Option<String>,
    /// `-o`: stdout path as written (relative to the submit directory).
    pub stdout: Option<String>,
    /// `-e`: stderr path as written.
    pub stderr: Option<String>,
    /// `-j`: join of stdout and stderr.
    pub join: Option<Join>,
    /// `-l walltime=`: walltime limit, seconds.
    pub walltime: Option<u64>,
    /// `-l nodes=1:ppn=N`, `-l ncpus=N`, `-l select=1:ncpus=N`: job slots
    /// (cores) on one VM, `1..=MAX_SLOTS`. The last one given wins.
    pub slots: Option<u32>,
    /// `-l mem=M` or `-l select=1:mem=M`: memory limit, bytes (Torque's
    /// `size` format, [`parse_size`]).
    pub mem: Option<u64>,
    /// Other `-l` resources, in order (kept for information, not enforced).
    pub resources: Vec<Resource>,
    /// `-v`: variables in order; a later entry for the same name wins.
    pub vars: Vec<(String, VarValue)>,
    /// `-V`: export the whole submit environment.
    pub export_all: bool,
    /// `-d`: initial working directory as written.
    pub workdir: Option<String>,
    /// `-S`: absolute path of the shell.
    pub shell: Option<String>,
    /// `-r`: rerunnable.
    pub rerunnable: Option<bool>,
    /// `-W umask=`: file mode creation mask (at most `0o777`).
    pub umask: Option<u32>,
    /// `-W group_list=`: group the job runs as.
    pub group: Option<String>,
    /// `-W depend=`: dependencies ([`parse_depend`]); several `-W depend=`
    /// of one source accumulate.
    pub depend: Vec<Dependency>,
    /// Options accepted but ignored, and directives after the first command.
    pub warnings: Vec<Warning>,
}

impl Directives {
    /// Applies option `-<option>` with `value` (which must be `Some` for every
    /// option but `-V`), as `qsub` does: scalar options replace earlier
    /// values, list options (`-l`, `-v`, `-W`) accumulate. `line` is used only
    /// for warnings.
    ///
    /// # Errors
    /// [`PbsError::UnknownOption`], [`PbsError::MissingValue`] or
    /// [`PbsError::InvalidValue`].
    pub fn apply_option(
        &mut self,
        option: char,
        value: Option<&str>,
        line: Option<usize>,
    ) -> Result<(), PbsError> {
        if option == 'V' {
            self.export_all = true;
            return Ok(());
        }
        if !takes_value(option) {
            return Err(PbsError::UnknownOption {
                option: option.to_string(),
            });
        }
        let value = value.ok_or(PbsError::MissingValue { option })?;
        match option {
            'N' => {
                validate_job_name(value).map_err(|reason| PbsError::invalid('N', value, reason))?;
                self.name = Some(value.to_string());
            }
            'q' => {
                let (queue, server) = match value.split_once('@') {
                    Some((q, s)) => (q, Some(s)),
                    None => (value, None),
                };
                if !valid_name(queue) {
                    return Err(PbsError::invalid(
                        'q',
                        value,
                        "a pool name is 1-64 characters of a-z A-Z 0-9 _ -",
                    ));
                }
                if let Some(server) = server {
                    self.warn(
                        line,
                        format!("-q: server {server:?} ignored (vq submits to its own cluster)"),
                    );
                }
                self.queue = Some(queue.to_string());
            }
            'o' => self.stdout = Some(self.output_path('o', value, line)?),
            'e' => self.stderr = Some(self.output_path('e', value, line)?),
            'j' => self.join = Some(parse_join(value)?),
            'l' => self.apply_resources(value, line)?,
            'v' => {
                for var in parse_var_list(value)? {
                    self.vars.push(var);
                }
            }
            'd' => {
                if value.is_empty() {
                    return Err(PbsError::invalid('d', value, "empty directory"));
                }
                self.workdir = Some(value.to_string());
            }
            'S' => self.shell = Some(parse_shell_list(value)?),
            'r' => {
                self.rerunnable = Some(match value {
                    "y" | "Y" => true,
                    "n" | "N" => false,
                    _ => return Err(PbsError::invalid('r', value, "expected y or n")),
                })
            }
            'W' => self.apply_attributes(value, line)?,
            'm' | 'M' => self.warn(line, format!("-{option}: ignored (vq sends no mail)")),
            'A' => self.warn(line, "-A: ignored (vq keeps no accounts)".to_string()),
            _ => unreachable!("takes_value lists exactly the options handled here"),
        }
        Ok(())
    }

    /// Returns `self` (from the script) overridden by `cli` (from the
    /// command line): a scalar given on the command line wins (Torque: "the
    /// command line takes precedence"); `-l` resources and `-v` variables are
    /// merged with the command line's later, so it wins for the same name;
    /// `-V` is set if either sets it; warnings are concatenated.
    pub fn overridden_by(self, cli: Directives) -> Directives {
        let mut resources = self.resources;
        for r in cli.resources {
            resources.retain(|old| old.name != r.name);
            resources.push(r);
        }
        let mut vars = self.vars;
        vars.extend(cli.vars);
        let mut warnings = self.warnings;
        warnings.extend(cli.warnings);
        Directives {
            name: cli.name.or(self.name),
            queue: cli.queue.or(self.queue),
            stdout: cli.stdout.or(self.stdout),
            stderr: cli.stderr.or(self.stderr),
            join: cli.join.or(self.join),
            walltime: cli.walltime.or(self.walltime),
            slots: cli.slots.or(self.slots),
            mem: cli.mem.or(self.mem),
            resources,
            vars,
            export_all: cli.export_all || self.export_all,
            workdir: cli.workdir.or(self.workdir),
            shell: cli.shell.or(self.shell),
            rerunnable: cli.rerunnable.or(self.rerunnable),
            umask: cli.umask.or(self.umask),
            group: cli.group.or(self.group),
            // Like a scalar: dependencies given on the command line replace
            // the script's (a user resubmitting a script with other
            // dependencies must not get both).
            depend: if cli.depend.is_empty() {
                self.depend
            } else {
                cli.depend
            },
            warnings,
        }
    }

    fn warn(&mut self, line: Option<usize>, message: String) {
        self.warnings.push(Warning { line, message });
    }

    /// `-o`/`-e` take `[hostname:]path`; vq writes on the execution VM's
    /// (shared) file system, so a host part is dropped with a warning.
    fn output_path(
        &mut self,
        option: char,
        value: &str,
        line: Option<usize>,
    ) -> Result<String, PbsError> {
        let path = match value.split_once(':') {
            Some((host, path)) if !host.is_empty() && !host.contains('/') => {
                self.warn(
                    line,
                    format!("-{option}: host {host:?} ignored (output is written on the execution host)"),
                );
                path
            }
            _ => value,
        };
        if path.is_empty() {
            return Err(PbsError::invalid(option, value, "empty path"));
        }
        if path.contains('\0') {
            return Err(PbsError::invalid(option, value, "path contains a NUL byte"));
        }
        Ok(path.to_string())
    }

    fn apply_resources(&mut self, value: &str, line: Option<usize>) -> Result<(), PbsError> {
        for item in value.split(',') {
            if item.is_empty() {
                return Err(PbsError::invalid('l', value, "empty resource in list"));
            }
            let (name, val) = item.split_once('=').unwrap_or((item, ""));
            if name.is_empty() {
                return Err(PbsError::invalid('l', value, "resource without a name"));
            }
            match name {
                "walltime" => {
                    self.walltime = Some(parse_walltime(val)?);
                    continue;
                }
                "nodes" => {
                    self.slots = Some(parse_nodes(val)?);
                    continue;
                }
                "ncpus" => {
                    self.slots = Some(parse_slots(name, val)?);
                    continue;
                }
                "mem" => {
                    self.mem = Some(parse_size(val).map_err(|reason| PbsError::Resource {
                        value: item.to_string(),
                        reason,
                    })?);
                    continue;
                }
                "select" => {
                    let (slots, mem) = parse_select(val)?;
                    self.slots = slots.or(self.slots);
                    self.mem = mem.or(self.mem);
                    continue;
                }
                _ => {}
            }
            self.warn(
                line,
                format!("-l {name}: kept but not enforced (vq enforces walltime, nodes=1:ppn, ncpus, mem and select=1)"),
            );
            self.resources.retain(|r| r.name != name);
            self.resources.push(Resource {
                name: name.to_string(),
                value: val.to_string(),
            });
        }
        Ok(())
    }

    /// `-W attr=value[,attr=value]`. `umask`, `group_list` and `depend`
    /// ([`parse_depend`]) are honoured; `stagein` and `stageout` are refused
    /// because running the job without them would change its meaning; other
    /// attributes are ignored with a warning.
    fn apply_attributes(&mut self, value: &str, line: Option<usize>) -> Result<(), PbsError> {
        // group_list itself may be a comma list (`grp@host,grp2`), so split
        // on commas only before a word followed by '='.
        for (attr, val) in split_attributes(value) {
            match attr {
                "umask" => self.umask = Some(parse_umask(val)?),
                "group_list" => self.group = Some(parse_group_list(val)?),
                "depend" => self.depend.extend(parse_depend(val)?),
                "stagein" | "stageout" => {
                    return Err(PbsError::invalid(
                        'W',
                        value,
                        format!("{attr} is not supported by vq"),
                    ))
                }
                "" => return Err(PbsError::invalid('W', value, "expected attr=value")),
                other => self.warn(line, format!("-W {other}: ignored (not supported by vq)")),
            }
        }
        Ok(())
    }
}

/// Options that take a value (all supported ones but `-V`).
fn takes_value(option: char) -> bool {
    matches!(
        option,
        'N' | 'q' | 'o' | 'e' | 'j' | 'l' | 'v' | 'd' | 'S' | 'r' | 'W' | 'm' | 'M' | 'A'
    )
}

fn split_attributes(value: &str) -> Vec<(&str, &str)> {
    let mut out: Vec<(&str, &str)> = Vec::new();
    let mut start = 0;
    let bytes = value.as_bytes();
    let mut i = 0;
    while i <= bytes.len() {
        let at_end = i == bytes.len();
        let next_is_attr = !at_end
            && bytes[i] == b','
            && value[i + 1..]
                .split(',')
                .next()
                .is_some_and(|w| w.contains('='));
        if at_end || next_is_attr {
            let item = &value[start..i];
            let (a, v) = item.split_once('=').unwrap_or(("", item));
            out.push((a, v));
            start = i + 1;
        }
        i += 1;
    }
    out
}

/// Parses a `-W depend=` value, Torque's `type:id[:id...][,type:id...]`
/// (qsub(1), "depend"), for the types vq honours: `afterok`, `afternotok`
/// and `afterany` ([`DependKind`]). Ids are kept as written (at most
/// [`MAX_JOB_ID_BYTES`] bytes, no blanks); a type listed twice keeps both
/// entries (all must hold).
///
/// # Errors
/// [`PbsError::InvalidValue`] for option `W`: an empty list or entry, a
/// type without ids (`afterok`, `afterok:`), an empty or over-long id, or
/// a type vq does not support (`before`, `beforeok`, `after`, `syncwith`,
/// `on`, …: named as unsupported, with the supported ones).
pub fn parse_depend(value: &str) -> Result<Vec<Dependency>, PbsError> {
    let bad = |reason: String| PbsError::invalid('W', &format!("depend={value}"), reason);
    if value.is_empty() {
        return Err(bad("empty dependency list".into()));
    }
    let mut out = Vec::new();
    for entry in value.split(',') {
        let mut parts = entry.split(':');
        let word = parts.next().unwrap_or("");
        let kind = match DependKind::ALL.into_iter().find(|k| k.word() == word) {
            Some(k) => k,
            None if word.is_empty() => return Err(bad("empty dependency".into())),
            None if matches!(
                word,
                "after"
                    | "before"
                    | "beforeok"
                    | "beforenotok"
                    | "beforeany"
                    | "on"
                    | "syncwith"
                    | "synccount"
            ) =>
            {
                return Err(bad(format!(
                    "dependency type {word:?} is not supported by vq (supported: afterok, afternotok, afterany)"
                )))
            }
            None => {
                return Err(bad(format!(
                    "unknown dependency type {word:?} (supported: afterok, afternotok, afterany)"
                )))
            }
        };
        // A repeated id adds nothing (Torque's lists are sets).
        let mut jobs: Vec<String> = Vec::new();
        for id in parts {
            if !jobs.iter().any(|j| j == id) {
                jobs.push(id.to_string());
            }
        }
        if jobs.is_empty() {
            return Err(bad(format!(
                "{word} names no job (expected {word}:ID[:ID...])"
            )));
        }
        for id in &jobs {
            if id.is_empty() {
                return Err(bad(format!("empty job id in {entry:?}")));
            }
            if id.len() > MAX_JOB_ID_BYTES {
                return Err(bad(format!(
                    "job id of {} bytes (at most {MAX_JOB_ID_BYTES})",
                    id.len()
                )));
            }
            if id.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(bad(format!("job id {id:?} contains a blank")));
            }
        }
        out.push(Dependency { kind, jobs });
    }
    let n: usize = out.iter().map(|d| d.jobs.len()).sum();
    if n > MAX_DEPENDENCIES {
        return Err(bad(format!(
            "{n} job ids (at most {MAX_DEPENDENCIES}: a job waits on a bounded set; chain a job that waits on the rest)"
        )));
    }
    Ok(out)
}

/// Most job ids one `-W depend=` may name (after removing repeats): each is
/// looked up in the job table whenever the table changes, and kept in the
/// job's record.
pub const MAX_DEPENDENCIES: usize = 1000;

fn parse_umask(val: &str) -> Result<u32, PbsError> {
    let digits = val.strip_prefix("0o").unwrap_or(val);
    if digits.is_empty() || digits.len() > 4 || !digits.bytes().all(|b| (b'0'..=b'7').contains(&b))
    {
        return Err(PbsError::invalid(
            'W',
            &format!("umask={val}"),
            "umask is an octal number such as 022",
        ));
    }
    let mask = u32::from_str_radix(digits, 8)
        .map_err(|_| PbsError::invalid('W', &format!("umask={val}"), "umask is an octal number"))?;
    if mask > 0o777 {
        return Err(PbsError::invalid(
            'W',
            &format!("umask={val}"),
            "umask must be at most 0777",
        ));
    }
    Ok(mask)
}

/// `group_list=g1[@host][,g2@host2]`: the first entry without a host, else
/// the first entry's group.
fn parse_group_list(val: &str) -> Result<String, PbsError> {
    let entries: Vec<&str> = val.split(',').collect();
    let chosen = entries
        .iter()
        .find(|e| !e.contains('@'))
        .copied()
        .or_else(|| entries.first().map(|e| e.split('@').next().unwrap_or("")))
        .unwrap_or("");
    if !valid_unix_name(chosen) {
        return Err(PbsError::invalid(
            'W',
            &format!("group_list={val}"),
            "not a valid group name",
        ));
    }
    Ok(chosen.to_string())
}

/// Whether `name` looks like a Unix user or group name (POSIX portable
/// characters, not starting with `-`, at most 32 characters).
fn valid_unix_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 32
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// Parses `-j`: `oe`, `eo` or `n`.
///
/// # Errors
/// [`PbsError::InvalidValue`].
pub fn parse_join(value: &str) -> Result<Join, PbsError> {
    match value {
        "oe" => Ok(Join::Oe),
        "eo" => Ok(Join::Eo),
        "n" => Ok(Join::N),
        _ => Err(PbsError::invalid('j', value, "expected oe, eo or n")),
    }
}

/// Parses `-v VAR[=value][,VAR2[=value]]`. Names follow the shell:
/// `[A-Za-z_][A-Za-z0-9_]*`. Values cannot contain commas (as in Torque).
///
/// # Errors
/// [`PbsError::InvalidValue`] naming the bad entry.
pub fn parse_var_list(value: &str) -> Result<Vec<(String, VarValue)>, PbsError> {
    let mut out = Vec::new();
    for item in value.split(',') {
        let (name, val) = match item.split_once('=') {
            Some((n, v)) => (n, VarValue::Given(v.to_string())),
            None => (item, VarValue::FromEnvironment),
        };
        if !valid_var_name(name) {
            return Err(PbsError::invalid(
                'v',
                value,
                format!("{name:?} is not a variable name"),
            ));
        }
        out.push((name.to_string(), val));
    }
    Ok(out)
}

/// Whether `name` is a shell variable name.
pub fn valid_var_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Parses `-S path[@host][,path@host]`: the first entry without a host, else
/// the first entry's path. The path must be absolute.
///
/// # Errors
/// [`PbsError::InvalidValue`].
pub fn parse_shell_list(value: &str) -> Result<String, PbsError> {
    let entries: Vec<&str> = value.split(',').collect();
    let chosen = entries
        .iter()
        .find(|e| !e.contains('@'))
        .copied()
        .unwrap_or_else(|| entries[0].split('@').next().unwrap_or(""));
    if !chosen.starts_with('/') {
        return Err(PbsError::invalid(
            'S',
            value,
            "the shell must be an absolute path",
        ));
    }
    if chosen.contains(char::is_whitespace) || chosen.contains('\0') {
        return Err(PbsError::invalid(
            'S',
            value,
            "the shell path contains blanks",
        ));
    }
    Ok(chosen.to_string())
}

/// Checks a job name: 1 to [`MAX_JOB_NAME_LEN`] printable ASCII characters,
/// no blanks, no `/` (the name is part of the default output file names,
/// `<name>.o<seq>`), and not starting with `-` or `.`. Torque requires
/// "printable, non-white-space characters"; the `/` and leading-character
/// rules are vq's, to keep output file names safe.
///
/// # Errors
/// A sentence saying what is wrong.
pub fn validate_job_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the job name is empty".into());
    }
    if name.chars().count() > MAX_JOB_NAME_LEN {
        return Err(format!(
            "the job name is longer than {MAX_JOB_NAME_LEN} characters"
        ));
    }
    if let Some(c) = name.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "the job name contains {c:?}; only printable ASCII without blanks is allowed"
        ));
    }
    if name.contains('/') {
        return Err("the job name contains '/'".into());
    }
    if name.starts_with('-') || name.starts_with('.') {
        return Err("the job name starts with '-' or '.'".into());
    }
    Ok(())
}

/// Turns any string (e.g. a script file name) into a valid job name:
/// characters that [`validate_job_name`] rejects become `_`, a leading `-`
/// or `.` becomes `_`, and the result is cut to [`MAX_JOB_NAME_LEN`].
/// An empty input gives `STDIN`, Torque's name for a script read from stdin.
pub fn sanitize_job_name(raw: &str) -> String {
    if raw.is_empty() {
        return "STDIN".into();
    }
    raw.chars()
        .take(MAX_JOB_NAME_LEN)
        .enumerate()
        .map(|(i, c)| {
            if !c.is_ascii_graphic() || c == '/' || (i == 0 && (c == '-' || c == '.')) {
                '_'
            } else {
                c
            }
        })
        .collect()
}

/// Parses a Torque walltime: `SS`, `MM:SS`, `HH:MM:SS` or `D:HH:MM:SS`
/// (the leading field may exceed its usual range, e.g. `100:00:00` or
/// `90:00`; later fields are 0-59, hours after days 0-23), optionally with a
/// fractional second (`.5`, rounded up so that a limit is never shorter than
/// asked). The result is in `1..=MAX_WALLTIME_SECS` seconds.
///
/// Torque's `pbs_resources(7)` documents `[[HH:]MM:]SS[.milliseconds]`; the
/// days form is accepted because Moab and Slurm users write it.
///
/// # Errors
/// [`PbsError::Walltime`] saying what is wrong.
pub fn parse_walltime(value: &str) -> Result<u64, PbsError> {
    let bad = |reason: &str| PbsError::Walltime {
        value: value.to_string(),
        reason: reason.to_string(),
    };
    if value.is_empty() {
        return Err(bad("empty"));
    }
    let (main, frac) = match value.split_once('.') {
        Some((m, f)) => (m, Some(f)),
        None => (value, None),
    };
    let fields: Vec<&str> = main.split(':').collect();
    if fields.len() > 4 {
        return Err(bad("too many fields; expected [[[D:]HH:]MM:]SS"));
    }
    let mut numbers = Vec::with_capacity(fields.len());
    for (i, f) in fields.iter().enumerate() {
        if f.is_empty() || !f.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad("fields must be decimal digits"));
        }
        if i > 0 && f.len() > 2 {
            return Err(bad("fields after the first have at most two digits"));
        }
        let n: u64 = if f.len() > 20 {
            return Err(bad("number too large"));
        } else {
            f.parse().map_err(|_| bad("number too large"))?
        };
        numbers.push(n);
    }
    // Units from the last field backwards: seconds, minutes, hours, days.
    const UNITS: [u64; 4] = [1, 60, 3600, 86_400];
    const LIMITS: [u64; 4] = [60, 60, 24, u64::MAX];
    let count = numbers.len();
    let mut total: u64 = 0;
    for (k, n) in numbers.iter().rev().enumerate() {
        let leading = k == count - 1;
        if !leading && *n >= LIMITS[k] {
            return Err(bad(match k {
                0 => "seconds must be below 60",
                1 => "minutes must be below 60",
                _ => "hours must be below 24 when days are given",
            }));
        }
        total = n
            .checked_mul(UNITS[k])
            .and_then(|v| v.checked_add(total))
            .ok_or_else(|| bad("too large"))?;
    }
    if let Some(frac) = frac {
        if frac.is_empty() || !frac.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad("the fraction must be decimal digits"));
        }
        if frac.bytes().any(|b| b != b'0') {
            total = total.checked_add(1).ok_or_else(|| bad("too large"))?;
        }
    }
    if total == 0 {
        return Err(bad("must be at least one second"));
    }
    if total > MAX_WALLTIME_SECS {
        return Err(bad("longer than 100 years"));
    }
    Ok(total)
}

/// Parses Torque's `size` format (`pbs_resources(7)`, "size"):
/// `integer[suffix]` where the suffix is `b` (bytes, the default) or `w`
/// (words of [`WORD_BYTES`]), optionally prefixed by `k`, `m`, `g`, `t`
/// (powers of 1024: Torque's multipliers are binary), case-insensitive.
/// Returns bytes, at least 1.
///
/// # Errors
/// A sentence saying what is wrong (empty, not a number, unknown suffix,
/// zero, overflow).
pub fn parse_size(value: &str) -> Result<u64, String> {
    let lower = value.to_ascii_lowercase();
    let digits_end = lower
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(lower.len());
    let (num, suffix) = lower.split_at(digits_end);
    if num.is_empty() {
        return Err(format!(
            "size {value:?} does not start with a number (expected e.g. 512mb, 4gb)"
        ));
    }
    let n: u64 = num
        .parse()
        .map_err(|_| format!("size {value:?} is too large"))?;
    let (scale, unit) = match suffix {
        "" | "b" => (1, 1),
        "w" => (1, WORD_BYTES),
        _ => {
            let mut cs = suffix.chars();
            let prefix = cs.next();
            let unit = match cs.as_str() {
                "b" => 1,
                "w" => WORD_BYTES,
                _ => 0,
            };
            let scale: u64 = match prefix {
                Some('k') => 1 << 10,
                Some('m') => 1 << 20,
                Some('g') => 1 << 30,
                Some('t') => 1 << 40,
                _ => 0,
            };
            if unit == 0 || scale == 0 {
                return Err(format!(
                    "size {value:?} has an unknown suffix {suffix:?} (expected b, kb, mb, gb, tb, or w, kw, mw, gw, tw)"
                ));
            }
            (scale, unit)
        }
    };
    let bytes = n
        .checked_mul(scale)
        .and_then(|v| v.checked_mul(unit))
        .ok_or_else(|| format!("size {value:?} is too large"))?;
    if bytes == 0 {
        return Err(format!("size {value:?} is zero"));
    }
    Ok(bytes)
}

/// Parses a slot count (`ppn`, `ncpus`): `1..=MAX_SLOTS`.
fn parse_slots(name: &str, value: &str) -> Result<u32, PbsError> {
    let bad = |reason: String| PbsError::Resource {
        value: format!("{name}={value}"),
        reason,
    };
    let n: u32 = value
        .parse()
        .map_err(|_| bad(format!("{name} is a whole number of cores, e.g. {name}=4")))?;
    if n == 0 || n > MAX_SLOTS {
        return Err(bad(format!("{name} must be between 1 and {MAX_SLOTS}")));
    }
    Ok(n)
}

/// Parses Torque's `nodes={N|host}[:ppn=P][:property…]` (`qsub(1)`,
/// `-l nodes`): vq runs a job on one VM, so `N` must be 1 (a host name or
/// property is ignored: the pool chooses the VM) and `+` (several node
/// specs) is refused. Returns the slots, `ppn` (default 1).
fn parse_nodes(value: &str) -> Result<u32, PbsError> {
    let whole = format!("nodes={value}");
    let bad = |reason: &str| PbsError::Resource {
        value: whole.clone(),
        reason: reason.to_string(),
    };
    if value.contains('+') {
        return Err(bad(
            "several node specifications: vq runs a job on one VM (use nodes=1:ppn=N)",
        ));
    }
    let mut parts = value.split(':');
    let first = parts.next().unwrap_or("");
    if first.is_empty() {
        return Err(bad("expected nodes=1[:ppn=N]"));
    }
    if first.bytes().all(|b| b.is_ascii_digit()) && first != "1" {
        return Err(bad(
            "more than one node: vq runs a job on one VM (use nodes=1:ppn=N)",
        ));
    }
    let mut slots = 1;
    for p in parts {
        if let Some(ppn) = p.strip_prefix("ppn=") {
            slots = parse_slots("ppn", ppn)?;
        }
    }
    Ok(slots)
}

/// Parses PBS Pro's `select=[N:]chunk` where `chunk` is
/// `res=value[:res=value…]` (`pbs_resources(7B)`): one chunk on one VM, so
/// `N` must be 1 and `+` (several chunks) is refused. Returns the
/// `ncpus` and `mem` of the chunk (other chunk resources are ignored).
fn parse_select(value: &str) -> Result<(Option<u32>, Option<u64>), PbsError> {
    let whole = format!("select={value}");
    let bad = |reason: String| PbsError::Resource {
        value: whole.clone(),
        reason,
    };
    if value.contains('+') {
        return Err(bad(
            "several chunks: vq runs a job on one VM (use select=1:ncpus=N:mem=M)".into(),
        ));
    }
    let mut parts = value.split(':').peekable();
    if let Some(first) = parts.peek().copied() {
        if !first.contains('=') {
            if first != "1" {
                return Err(bad(
                    "more than one chunk: vq runs a job on one VM (use select=1:ncpus=N)".into(),
                ));
            }
            parts.next();
        }
    }
    let (mut slots, mut mem) = (None, None);
    for p in parts {
        match p.split_once('=') {
            Some(("ncpus", n)) => slots = Some(parse_slots("ncpus", n)?),
            Some(("mem", m)) => mem = Some(parse_size(m).map_err(bad)?),
            Some(_) => {}
            None => return Err(bad(format!("{p:?} is not res=value"))),
        }
    }
    Ok((slots, mem))
}

/// Formats `bytes` as a Torque size that [`parse_size`] reads back: the
/// largest of `tb`, `gb`, `mb`, `kb` (powers of 1024) that divides it
/// exactly, else `b` (`4294967296` → `4gb`, `1536` → `1536b`).
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [(40, "tb"), (30, "gb"), (20, "mb"), (10, "kb")] {
        if bytes != 0 && bytes % (1u64 << shift) == 0 {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    format!("{bytes}b")
}

/// Formats seconds as Torque prints walltimes: `HH:MM:SS` (hours may exceed
/// 99). [`parse_walltime`] reads it back.
pub fn format_walltime(secs: u64) -> String {
    format!(
        "{:02}:{:02}:{:02}",
        secs / 3600,
        (secs / 60) % 60,
        secs % 60
    )
}

/// Splits a directive's option text into words like a POSIX shell: blanks
/// separate words; `'…'` is literal; in `"…"` a backslash escapes `"`, `\`,
/// `$` and `` ` ``; outside quotes a backslash escapes any character. An
/// unquoted `#` at the start of a word starts a comment that runs to the end
/// of the line. No expansion is done (Torque does none either).
///
/// # Errors
/// [`PbsError::UnterminatedQuote`].
pub fn split_words(text: &str) -> Result<Vec<String>, PbsError> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            '#' if !in_word => break,
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(ch) => cur.push(ch),
                        None => return Err(PbsError::UnterminatedQuote { quote: '\'' }),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.peek() {
                            Some(&n) if matches!(n, '"' | '\\' | '$' | '`') => {
                                cur.push(n);
                                chars.next();
                            }
                            _ => cur.push('\\'),
                        },
                        Some(ch) => cur.push(ch),
                        None => return Err(PbsError::UnterminatedQuote { quote: '"' }),
                    }
                }
            }
            '\\' => {
                in_word = true;
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

/// Applies the options in `words` (getopt style: `-N name`, `-Nname`, and
/// `-V` clustered with a following option, `-Vj oe`) to `dirs`.
fn apply_words(dirs: &mut Directives, words: &[String], line: usize) -> Result<(), PbsError> {
    let mut i = 0;
    while i < words.len() {
        let word = &words[i];
        i += 1;
        let Some(mut rest) = word.strip_prefix('-').filter(|r| !r.is_empty()) else {
            return Err(PbsError::UnexpectedArgument { word: word.clone() });
        };
        loop {
            let mut it = rest.chars();
            let Some(option) = it.next() else { break };
            let after = it.as_str();
            if option == 'V' {
                dirs.apply_option('V', None, Some(line))?;
                rest = after;
                continue;
            }
            if !takes_value(option) {
                return Err(PbsError::UnknownOption {
                    option: option.to_string(),
                });
            }
            let value = if !after.is_empty() {
                after.to_string()
            } else if i < words.len() {
                i += 1;
                words[i - 1].clone()
            } else {
                return Err(PbsError::MissingValue { option });
            };
            dirs.apply_option(option, Some(&value), Some(line))?;
            break;
        }
    }
    Ok(())
}

/// Reads the `#PBS` directives of a job script.
///
/// Scanning follows Torque (see the module docs): it stops at the first line
/// that is neither blank nor a comment; `#PBS` lines after that are ignored
/// with a warning. A line whose first word is `#PBS` followed by a blank (or
/// nothing) is a directive; `#PBSX` is an ordinary comment. Carriage returns
/// at line ends are ignored.
///
/// # Errors
/// [`PbsError::AtLine`] with the 1-based line number and the problem (an
/// unknown option, a bad value, an unterminated quote).
pub fn parse_script(text: &str) -> Result<Directives, PbsError> {
    let mut dirs = Directives::default();
    let mut in_header = true;
    for (idx, raw) in text.lines().enumerate() {
        let line_no = idx + 1;
        let line = raw.strip_suffix('\r').unwrap_or(raw).trim_start();
        let directive = line
            .strip_prefix("#PBS")
            .filter(|rest| rest.is_empty() || rest.starts_with(char::is_whitespace));
        if !in_header {
            if directive.is_some() {
                dirs.warn(
                    Some(line_no),
                    "#PBS directive after the first command ignored (directives must precede all commands)"
                        .to_string(),
                );
            }
            continue;
        }
        match directive {
            Some(rest) => {
                let words = split_words(rest).map_err(|e| e.at_line(line_no))?;
                apply_words(&mut dirs, &words, line_no).map_err(|e| e.at_line(line_no))?;
            }
            None if line.is_empty() || line.starts_with('#') => {}
            None => in_header = false,
        }
    }
    Ok(dirs)
}

#[cfg(test)]
mod tests;
