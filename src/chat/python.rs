//! Values printed as Python prints them (`True`, `None`, `['a', 1]`, `1e+16`).

use minijinja::{ErrorKind, Value};

use super::bounds::{check_built_len, check_depth};

/// Prints values as jinja2 does where Python differs from minijinja's
/// default: `True`, `None`, floats (`1e+16`), and lists and dicts as
/// Python's `str()` writes them (`['a', 1]`, `{'k': None}`).
pub(super) fn python_formatter(
    out: &mut minijinja::Output<'_>,
    state: &mut minijinja::State<'_, '_>,
    value: &Value,
) -> std::result::Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    match value.kind() {
        ValueKind::Bool | ValueKind::None | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            python_repr(&mut text, value, 0)?;
            out.write_str(&text).map_err(io_error)
        }
        ValueKind::Number if !is_integer(value) => {
            let mut text = String::new();
            python_repr(&mut text, value, 0)?;
            out.write_str(&text).map_err(io_error)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr` of a value (what `str()` of a list or dict writes for
/// each item).
fn python_repr(out: &mut String, value: &Value, depth: usize) -> std::result::Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    check_depth(depth, "a printed value")?;
    check_built_len(out.len(), "a printed value")?;
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if is_integer(value) => out.push_str(&value.to_string()),
        ValueKind::Number => {
            let repr = python_float_repr(f64::try_from(value.clone()).unwrap_or(f64::NAN));
            out.push_str(match repr.as_str() {
                "NaN" => "nan",
                "Infinity" => "inf",
                "-Infinity" => "-inf",
                other => other,
            });
        }
        ValueKind::String => python_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &item, depth + 1)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &key, depth + 1)?;
                out.push_str(": ");
                python_repr(out, &value.get_item(&key)?, depth + 1)?;
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
    Ok(())
}

/// Python's `repr` of a string: single quotes unless the text holds a
/// single quote and no double quote; non-printable characters escaped.
fn python_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !python_printable(c) => {
                let code = c as u32;
                let escaped = match code {
                    0..=0xff => format!("\\x{code:02x}"),
                    0x100..=0xffff => format!("\\u{code:04x}"),
                    _ => format!("\\U{code:08x}"),
                };
                out.push_str(&escaped);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable` for the characters it rejects that text
/// plausibly holds: controls, separators other than the space, and common
/// format characters. (Private-use characters count as printable here.)
fn python_printable(c: char) -> bool {
    !matches!(c as u32,
        0..=0x1f | 0x7f..=0xa0 | 0xad | 0x1680 | 0x2000..=0x200f | 0x2028..=0x202f
            | 0x205f..=0x2064 | 0x3000 | 0xfeff)
}

fn io_error(e: std::fmt::Error) -> minijinja::Error {
    minijinja::Error::new(ErrorKind::WriteFailure, "cannot write output").with_source(e)
}

/// Whether a number value is an integer (minijinja writes floats with a
/// `.`, an exponent, `inf` or `NaN`; integers as plain digits).
pub(super) fn is_integer(value: &Value) -> bool {
    let text = value.to_string();
    let digits = text.strip_prefix('-').unwrap_or(&text);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

pub(super) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Shortest round-trip digits and exponent, as `repr` picks them.
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').expect("{:e} has an exponent");
    let exponent: i32 = exponent.parse().expect("{:e} exponent is an integer");
    if (-4..16).contains(&exponent) {
        let plain = format!("{f}");
        if plain.contains('.') {
            plain
        } else {
            format!("{plain}.0")
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    }
}
