//! The per-key type check of a config document against the JSON Schema of
//! its type, before deserialising.
//!
//! serde stops at the first value of the wrong type, so a file with
//! `slots = "four"` and `heartbeat_secs = "often"` would name only one of
//! them and none of the value problems. Here the whole document is walked
//! against the schema [`schemars`] generates from the config types (the
//! schema published in `schemas/`), every key that does not fit is listed
//! with its dotted path and removed, and what is left deserialises; the
//! removed keys take their defaults, so `validate()` still runs over the
//! rest and its value problems join the same list.
//!
//! The walk knows the keywords schemars emits for the config types
//! ([`KEYWORDS`]; the `config` tests fail if a schema uses another one):
//! `type`, `properties`, `additionalProperties`, `required`, `items`,
//! `minimum`/`maximum`, `enum`/`const`, `anyOf`/`oneOf` and `$ref` into
//! `$defs`. Annotations (`description`, `default`, `format`, …) are
//! ignored.

use serde_json::Value as Json;

/// The JSON Schema keywords the walk understands or may ignore: the ones
/// schemars 1 writes for the config types. A schema keyword outside this
/// list would be silently ignored, so the `config` tests check the
/// generated schemas against it.
pub const KEYWORDS: &[&str] = &[
    "$schema",
    "$defs",
    "$ref",
    "title",
    "description",
    "default",
    "format",
    "examples",
    "deprecated",
    "type",
    "properties",
    "additionalProperties",
    "required",
    "items",
    "minimum",
    "maximum",
    "enum",
    "const",
    "anyOf",
    "oneOf",
];

/// One key that does not fit the schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyProblem {
    /// Dotted path of the key (`pools.cms.slots`, `deny_owners[1]`);
    /// empty for the document itself.
    pub path: String,
    /// What is wrong, worded to follow `<path>: `.
    pub problem: String,
}

impl std::fmt::Display for KeyProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = if self.path.is_empty() {
            "(document)"
        } else {
            &self.path
        };
        write!(f, "{path}: {}", self.problem)
    }
}

/// Checks `doc` against `schema` (a schemars root schema, `$defs` inside),
/// records every key that does not fit into `out`, and removes those keys
/// from `doc` so that the rest deserialises. Returns `false` if `doc` as a
/// whole does not fit (a required key is missing, or the document is not a
/// table), in which case deserialising it will fail.
pub fn prune(schema: &Json, doc: &mut toml::Value, out: &mut Vec<KeyProblem>) -> bool {
    Walk { root: schema }.value(schema, doc, "", out)
}

struct Walk<'a> {
    root: &'a Json,
}

impl<'a> Walk<'a> {
    /// The schema a `$ref` points to (`#/$defs/Name`, any JSON pointer into
    /// the root); `None` for a reference outside the document.
    fn resolve(&self, reference: &str) -> Option<&'a Json> {
        self.root.pointer(reference.strip_prefix('#')?)
    }

    /// Checks `value` at `path` against `schema`; `false` if it does not fit
    /// (problems recorded). Tables drop their keys that do not fit and
    /// still fit themselves unless a required key is missing.
    fn value(
        &self,
        schema: &'a Json,
        value: &mut toml::Value,
        path: &str,
        out: &mut Vec<KeyProblem>,
    ) -> bool {
        let Some(schema) = schema.as_object() else {
            // `true` accepts anything, `false` nothing.
            return schema.as_bool().unwrap_or(true) || {
                out.push(problem(path, "is not allowed here"));
                false
            };
        };
        if let Some(target) = schema.get("$ref").and_then(Json::as_str) {
            match self.resolve(target) {
                Some(s) => {
                    if !self.value(s, value, path, out) {
                        return false;
                    }
                }
                None => {
                    out.push(problem(
                        path,
                        format!("schema reference {target} is unknown"),
                    ));
                    return false;
                }
            }
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(branches) = schema.get(key).and_then(Json::as_array) {
                if !self.any_of(branches, value, path, out) {
                    return false;
                }
            }
        }
        if let Some(types) = schema.get("type") {
            if !fits_type(types, value) {
                out.push(problem(
                    path,
                    format!("expected {}, found {}", expected(types), found(value)),
                ));
                return false;
            }
        }
        if let toml::Value::Integer(n) = value {
            let n = i128::from(*n);
            let bound = |k: &str| schema.get(k).and_then(json_int);
            let (fmin, fmax) = schema
                .get("format")
                .and_then(Json::as_str)
                .and_then(format_range)
                .unzip();
            let (min, max) = (bound("minimum").or(fmin), bound("maximum").or(fmax));
            if min.is_some_and(|m| n < m) || max.is_some_and(|m| n > m) {
                let range = match (min, max) {
                    (Some(a), Some(b)) => format!("{a}..={b}"),
                    (Some(a), None) => format!("{a}.."),
                    (None, Some(b)) => format!("..={b}"),
                    (None, None) => unreachable!("a bound was crossed"),
                };
                out.push(problem(path, format!("{n} is out of range {range}")));
                return false;
            }
        }
        if let Some(allowed) = schema.get("enum").and_then(Json::as_array) {
            if !allowed.iter().any(|a| same(a, value)) {
                out.push(problem(
                    path,
                    format!("expected one of {}, found {}", list(allowed), found(value)),
                ));
                return false;
            }
        }
        if let Some(c) = schema.get("const") {
            if !same(c, value) {
                out.push(problem(
                    path,
                    format!("expected {c}, found {}", found(value)),
                ));
                return false;
            }
        }
        match value {
            toml::Value::Table(table) => self.table(schema, table, path, out),
            toml::Value::Array(items) => match schema.get("items") {
                Some(item) => {
                    let mut fits = true;
                    for (i, v) in items.iter_mut().enumerate() {
                        fits &= self.value(item, v, &format!("{path}[{i}]"), out);
                    }
                    fits
                }
                None => true,
            },
            _ => true,
        }
    }

    /// The keys of `table` against `properties`/`additionalProperties`/
    /// `required`; keys that do not fit are removed.
    fn table(
        &self,
        schema: &'a serde_json::Map<String, Json>,
        table: &mut toml::Table,
        path: &str,
        out: &mut Vec<KeyProblem>,
    ) -> bool {
        let props = schema.get("properties").and_then(Json::as_object);
        let extra = schema.get("additionalProperties");
        let keys: Vec<String> = table.keys().cloned().collect();
        for key in keys {
            let child_path = if path.is_empty() {
                key.clone()
            } else {
                format!("{path}.{key}")
            };
            let child_schema = match props.and_then(|p| p.get(&key)) {
                Some(s) => Some(s),
                None => match extra {
                    Some(Json::Bool(false)) => None,
                    Some(s) => Some(s),
                    None => continue,
                },
            };
            let fits = match child_schema {
                None => {
                    out.push(problem(&child_path, "unknown key"));
                    false
                }
                Some(s) => {
                    let v = table.get_mut(&key).expect("key listed above");
                    self.value(s, v, &child_path, out)
                }
            };
            if !fits {
                table.remove(&key);
            }
        }
        let mut fits = true;
        for req in schema
            .get("required")
            .and_then(Json::as_array)
            .into_iter()
            .flatten()
            .filter_map(Json::as_str)
        {
            if !table.contains_key(req) {
                let p = if path.is_empty() {
                    req.to_string()
                } else {
                    format!("{path}.{req}")
                };
                // A required key removed above already has its problem.
                if !out.iter().any(|o| o.path == p) {
                    out.push(problem(&p, "missing"));
                }
                fits = false;
            }
        }
        fits
    }

    /// `anyOf`/`oneOf`: the first branch that fits takes the value (with
    /// that branch's removals); if none fits, the problems of the branch
    /// that found the fewest are recorded.
    fn any_of(
        &self,
        branches: &'a [Json],
        value: &mut toml::Value,
        path: &str,
        out: &mut Vec<KeyProblem>,
    ) -> bool {
        let mut best: Option<Vec<KeyProblem>> = None;
        for branch in branches {
            // TOML has no null: a `null` branch (an `Option`) never fits.
            if branch.get("type").and_then(Json::as_str) == Some("null") {
                continue;
            }
            let mut trial = value.clone();
            let mut problems = Vec::new();
            if self.value(branch, &mut trial, path, &mut problems) {
                *value = trial;
                out.extend(problems);
                return true;
            }
            if best.as_ref().is_none_or(|b| problems.len() < b.len()) {
                best = Some(problems);
            }
        }
        out.extend(best.unwrap_or_else(|| vec![problem(path, "fits no allowed form")]));
        false
    }
}

fn problem(path: &str, text: impl Into<String>) -> KeyProblem {
    KeyProblem {
        path: path.to_string(),
        problem: text.into(),
    }
}

/// A JSON Schema type name of a TOML value; integers are numbers too.
fn fits_type(types: &Json, value: &toml::Value) -> bool {
    let one = |t: &str| {
        matches!(
            (t, value),
            ("string", toml::Value::String(_))
                | ("integer", toml::Value::Integer(_))
                | ("number", toml::Value::Integer(_) | toml::Value::Float(_))
                | ("boolean", toml::Value::Boolean(_))
                | ("array", toml::Value::Array(_))
                | ("object", toml::Value::Table(_))
        )
    };
    match types {
        Json::String(t) => one(t),
        Json::Array(ts) => ts.iter().filter_map(Json::as_str).any(one),
        _ => true,
    }
}

/// "a string", "an integer or a table", … for the schema's `type`.
fn expected(types: &Json) -> String {
    let name = |t: &str| match t {
        "string" => "a string",
        "integer" => "an integer",
        "number" => "a number",
        "boolean" => "a boolean (true or false)",
        "array" => "an array",
        "object" => "a table",
        _ => "a value",
    };
    match types {
        Json::String(t) => name(t).to_string(),
        Json::Array(ts) => ts
            .iter()
            .filter_map(Json::as_str)
            .filter(|t| *t != "null")
            .map(name)
            .collect::<Vec<_>>()
            .join(" or "),
        _ => "a value".into(),
    }
}

/// The value found, for messages; long strings are cut.
fn found(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => {
            let mut short: String = s.chars().take(40).collect();
            if short.len() < s.len() {
                short.push('…');
            }
            format!("the string {short:?}")
        }
        toml::Value::Integer(n) => format!("the integer {n}"),
        toml::Value::Float(x) => format!("the float {x:?}"),
        toml::Value::Boolean(b) => format!("the boolean {b}"),
        toml::Value::Datetime(d) => format!("the date-time {d}"),
        toml::Value::Array(_) => "an array".into(),
        toml::Value::Table(_) => "a table".into(),
    }
}

/// The range of an integer `format` schemars writes for Rust's integer
/// types (`uint32` for `u32`, `uint` for `usize` on a 64-bit target, …),
/// where it gives no `maximum`: a TOML integer outside it would pass the
/// type check and fail in serde alone.
fn format_range(format: &str) -> Option<(i128, i128)> {
    let bits = |digits: &str| match digits {
        "" => Some(64),
        "8" | "16" | "32" | "64" => digits.parse::<u32>().ok(),
        _ => None,
    };
    if let Some(d) = format.strip_prefix("uint") {
        let b = bits(d)?;
        Some((0, (1i128 << b) - 1))
    } else if let Some(d) = format.strip_prefix("int") {
        let b = bits(d)?;
        Some((-(1i128 << (b - 1)), (1i128 << (b - 1)) - 1))
    } else {
        None
    }
}

fn json_int(v: &Json) -> Option<i128> {
    v.as_i64()
        .map(i128::from)
        .or_else(|| v.as_u64().map(i128::from))
        .or_else(|| v.as_f64().map(|f| f as i128))
}

/// Whether a TOML scalar equals a JSON `enum`/`const` value.
fn same(json: &Json, value: &toml::Value) -> bool {
    match (json, value) {
        (Json::String(a), toml::Value::String(b)) => a == b,
        (Json::Bool(a), toml::Value::Boolean(b)) => a == b,
        (Json::Number(a), toml::Value::Integer(b)) => a.as_i64() == Some(*b),
        (Json::Number(a), toml::Value::Float(b)) => a.as_f64() == Some(*b),
        _ => false,
    }
}

fn list(values: &[Json]) -> String {
    values
        .iter()
        .map(Json::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(schema: Json, text: &str) -> (toml::Value, Vec<String>, bool) {
        let mut doc = toml::Value::Table(text.parse().unwrap());
        let mut out = Vec::new();
        let fits = prune(&schema, &mut doc, &mut out);
        (doc, out.iter().map(ToString::to_string).collect(), fits)
    }

    #[test]
    fn every_key_of_the_wrong_type_is_named_and_removed() {
        let schema = serde_json::json!({
            "type": "object",
            "additionalProperties": false,
            "properties": {
                "n": {"type": "integer", "minimum": 0, "maximum": 10},
                "x": {"type": "number"},
                "s": {"type": ["string", "null"]},
                "l": {"type": "array", "items": {"type": "string"}},
                "t": {"$ref": "#/$defs/T"},
                "m": {"type": "object", "additionalProperties": {"$ref": "#/$defs/T"}}
            },
            "$defs": {"T": {"type": "object", "additionalProperties": false,
                            "properties": {"b": {"type": "boolean"}}}}
        });
        let (doc, out, fits) = run(
            schema,
            "n = 11\nx = \"often\"\ns = 3\nl = [\"a\", 2]\ncolour = 1\n\
             [t]\nb = \"yes\"\nc = 1\n[m.one]\nb = true\n[m.two]\nb = 0\n",
        );
        assert!(fits);
        assert_eq!(
            out,
            [
                "colour: unknown key",
                "l[1]: expected a string, found the integer 2",
                "m.two.b: expected a boolean (true or false), found the integer 0",
                "n: 11 is out of range 0..=10",
                "s: expected a string, found the integer 3",
                "t.b: expected a boolean (true or false), found the string \"yes\"",
                "t.c: unknown key",
                "x: expected a number, found the string \"often\"",
            ]
        );
        let left: toml::Value = "[t]\n[m.one]\nb = true\n[m.two]\n"
            .parse::<toml::Table>()
            .unwrap()
            .into();
        assert_eq!(doc, left);
    }

    #[test]
    fn integer_formats_bound_what_serde_would_refuse() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "a": {"type": "integer", "format": "uint32", "minimum": 0},
                "b": {"type": "integer", "format": "int8"},
                "c": {"type": "integer", "format": "uint"}
            }
        });
        let (_, out, _) = run(
            schema,
            "a = 4294967296\nb = -129\nc = 9223372036854775807\n",
        );
        assert_eq!(
            out,
            [
                "a: 4294967296 is out of range 0..=4294967295",
                "b: -129 is out of range -128..=127",
            ]
        );
    }

    #[test]
    fn a_missing_required_key_makes_the_document_unfit() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"pool": {"type": "string"}, "id": {"type": "string"}},
            "required": ["pool", "id"]
        });
        let (_, out, fits) = run(schema, "pool = 1\n");
        assert!(!fits);
        assert_eq!(
            out,
            [
                "pool: expected a string, found the integer 1",
                "id: missing"
            ]
        );
    }

    #[test]
    fn an_optional_table_is_checked_through_any_of() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"o": {"anyOf": [{"$ref": "#/$defs/T"}, {"type": "null"}]}},
            "$defs": {"T": {"type": "object", "properties": {"k": {"type": "string"}}}}
        });
        let (_, out, _) = run(schema.clone(), "[o]\nk = \"v\"\n");
        assert!(out.is_empty(), "{out:?}");
        let (_, out, _) = run(schema, "o = 5\n");
        assert_eq!(out, ["o: expected a table, found the integer 5"]);
    }
}
