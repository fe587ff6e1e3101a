//! `tojson` as transformers' `json.dumps(ensure_ascii=False)` writes it.

use minijinja::value::{Kwargs, Rest};
use minijinja::{ErrorKind, Value};

use super::bounds::{check_built_len, check_depth, check_width};
use super::python::{is_integer, python_float_repr};

/// transformers' `tojson`: `json.dumps(value, ensure_ascii=False,
/// indent=indent, separators=(",", ": ") if indent else None,
/// sort_keys=False)`.
pub(super) fn tojson(
    value: &Value,
    args: Rest<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<Value> = match args.first() {
        Some(v) => Some(v.clone()),
        None => kwargs.get("indent")?,
    };
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => {
                check_width(n.max(0) as u64, "tojson indent")?;
                Some(" ".repeat(n.max(0) as usize))
            }
            (None, Some(s)) => {
                check_width(s.len() as u64, "the length of tojson's indent string")?;
                Some(s.to_string())
            }
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent is not a number",
                ))
            }
        },
    };
    let mut out = String::new();
    write_json(&mut out, value, indent.as_deref(), 0)?;
    // Marked safe so no auto-escaping touches it (none is configured anyway).
    Ok(Value::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    value: &Value,
    indent: Option<&str>,
    depth: usize,
) -> std::result::Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    check_depth(depth, "tojson")?;
    check_built_len(out.len(), "tojson")?;
    let item_sep = if indent.is_some() { "," } else { ", " };
    let newline = |out: &mut String, depth: usize| {
        if let Some(unit) = indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(unit);
            }
        }
        check_built_len(out.len(), "tojson")
    };
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            // Item by item, not collected first: a lazy list (`[x] * n`)
            // may hold far more items than the bound lets it write.
            let mut items = value.try_iter()?.peekable();
            if items.peek().is_none() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1)?;
                write_json(out, &item, indent, depth + 1)?;
            }
            newline(out, depth)?;
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys = value.try_iter()?.peekable();
            if keys.peek().is_none() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1)?;
                match key.kind() {
                    ValueKind::String => write_json_string(out, key.as_str().unwrap_or_default()),
                    ValueKind::Number | ValueKind::Bool | ValueKind::None => {
                        let mut scalar = String::new();
                        write_json(&mut scalar, &key, None, 0)?;
                        write_json_string(out, &scalar);
                    }
                    _ => {
                        return Err(minijinja::Error::new(
                            ErrorKind::InvalidOperation,
                            "tojson: keys must be str, int, float, bool or None",
                        ))
                    }
                }
                out.push_str(": ");
                write_json(out, &value.get_item(&key)?, indent, depth + 1)?;
            }
            newline(out, depth)?;
            out.push('}');
        }
        other => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of kind {other} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// Numbers as Python writes them: integers as they are, floats as `repr`
/// (`1.0`, `1e-05`, `1e+16`, `NaN`, `Infinity`).
fn write_number(out: &mut String, value: &Value) {
    if is_integer(value) {
        out.push_str(&value.to_string());
    } else {
        out.push_str(&python_float_repr(f64::try_from(value.clone()).unwrap_or(f64::NAN)));
    }
}

/// A JSON string as Python's `json.dumps(ensure_ascii=False)` writes it.
fn write_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}
