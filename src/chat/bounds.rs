//! The bounds a render stays within: fuel, output length, value depth,
//! and the widths filters and methods may ask for.

use minijinja::value::{Kwargs, Rest, StringInput, ValueOrKwargs};
use minijinja::{Environment, ErrorKind, Value};

use super::globals::raised_message;
use super::namespace;
use super::template::{describe, ChatTemplate};
use crate::error::{Error, Result};

impl ChatTemplate {
    /// Renders `env`'s template `name` with `context`, within the bounds.
    pub(super) fn render_bounded(
        &self,
        env: &Environment<'static>,
        name: String,
        context: Value,
    ) -> Result<String> {
        let template = env.get_template(&name).map_err(|e| Error::internal(describe(&e)))?;
        let mut output = BoundedOutput { text: Vec::new(), exceeded: false };
        match template.render_captured_to(context, &mut output) {
            // minijinja writes whole `str`s, so the bytes are UTF-8.
            Ok(_) => String::from_utf8(output.text)
                .map_err(|_| Error::internal("the rendered chat template is not UTF-8")),
            Err(e) => Err(self.render_error(&e, output.exceeded)),
        }
    }

    /// The error for a failed render: a bound passed, the template's
    /// `raise_exception`, or another failure on this conversation.
    fn render_error(&self, e: &minijinja::Error, output_exceeded: bool) -> Error {
        let bound = if output_exceeded {
            Some(format!("ChatTemplate::MAX_RENDERED_BYTES ({} bytes of text)", Self::MAX_RENDERED_BYTES))
        } else if out_of_fuel(e) {
            Some(format!("ChatTemplate::RENDER_FUEL ({} units of work)", Self::RENDER_FUEL))
        } else {
            bound_exceeded_message(e)
        };
        let fault = match bound {
            Some(bound) => Some(format!("exceeds {bound}")),
            None => namespace::namespace_stored(e)
                .then(|| "stores a namespace inside a namespace (where it could come to hold itself)".into()),
        };
        if let Some(fault) = fault {
            let reason = format!("the chat template {fault} rendering this conversation");
            return if self.from_checkpoint {
                Error::invalid(&self.path, reason)
            } else {
                Error::invalid_argument("template", reason)
            };
        }
        match raised_message(e) {
            Some(message) => Error::invalid_argument(
                "messages",
                format!("the chat template rejects the conversation: {message}"),
            ),
            None => Error::invalid_argument(
                "messages",
                format!(
                    "the chat template ({}) cannot render the conversation: {}",
                    self.path.display(),
                    describe(e)
                ),
            ),
        }
    }
}

/// Stack of the thread a template renders on: room for the deepest value
/// [`ChatTemplate::RENDER_FUEL`] can build (each level costs a few units)
/// to be walked recursively. Only the pages a render touches are used.
pub(super) const RENDER_STACK_BYTES: usize = 256 << 20;

/// The rendered text, refused past [`ChatTemplate::MAX_RENDERED_BYTES`] so
/// that a template writing without end stops as soon as it passes it.
struct BoundedOutput {
    text: Vec<u8>,
    exceeded: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len().saturating_add(buf.len()) > ChatTemplate::MAX_RENDERED_BYTES {
            self.exceeded = true;
            return Err(std::io::Error::other("the rendered text passes ChatTemplate::MAX_RENDERED_BYTES"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Whether `e` (or an error it wraps) is minijinja running out of fuel.
fn out_of_fuel(e: &minijinja::Error) -> bool {
    let mut error: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(current) = error {
        if current.downcast_ref::<minijinja::Error>().is_some_and(|m| m.kind() == ErrorKind::OutOfFuel) {
            return true;
        }
        error = current.source();
    }
    false
}

/// The error a filter or method attaches when the template asks for more
/// than a rendering bound allows; its text names the bound.
#[derive(Debug)]
struct BoundExceeded(String);

impl std::fmt::Display for BoundExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BoundExceeded {}

pub(super) fn bound_exceeded(bound: String) -> minijinja::Error {
    minijinja::Error::new(ErrorKind::InvalidOperation, bound.clone()).with_source(BoundExceeded(bound))
}

fn bound_exceeded_message(e: &minijinja::Error) -> Option<String> {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(bound) = s.downcast_ref::<BoundExceeded>() {
            return Some(bound.0.clone());
        }
        source = s.source();
    }
    None
}

/// A width, precision or indent a template asked for, refused past
/// [`ChatTemplate::MAX_FORMAT_WIDTH`].
pub(super) fn check_width(n: u64, what: &str) -> std::result::Result<(), minijinja::Error> {
    if n > ChatTemplate::MAX_FORMAT_WIDTH as u64 {
        return Err(bound_exceeded(format!(
            "ChatTemplate::MAX_FORMAT_WIDTH ({}) with {what} {n}",
            ChatTemplate::MAX_FORMAT_WIDTH
        )));
    }
    Ok(())
}

/// A text or value that has grown past [`ChatTemplate::MAX_RENDERED_BYTES`]
/// while a filter builds it: refused before it grows further.
pub(super) fn check_built_len(len: usize, what: &str) -> std::result::Result<(), minijinja::Error> {
    if len > ChatTemplate::MAX_RENDERED_BYTES {
        return Err(bound_exceeded(format!(
            "ChatTemplate::MAX_RENDERED_BYTES ({} bytes) in {what}",
            ChatTemplate::MAX_RENDERED_BYTES
        )));
    }
    Ok(())
}

/// Values nested deeper than this are refused by `tojson` and by printing
/// (both walk the value recursively; Python gives up near 1,000 levels).
const MAX_VALUE_DEPTH: usize = 128;

pub(super) fn check_depth(depth: usize, what: &str) -> std::result::Result<(), minijinja::Error> {
    if depth > MAX_VALUE_DEPTH {
        return Err(bound_exceeded(format!("{MAX_VALUE_DEPTH} levels of nesting in {what}")));
    }
    Ok(())
}

/// Every number a width or precision can hold in the printf-style format
/// string `format` (`%-10.3f`, `%(name)5s`), checked against
/// [`ChatTemplate::MAX_FORMAT_WIDTH`] before anything is formatted.
fn check_printf_widths(format: &str) -> std::result::Result<(), minijinja::Error> {
    let bytes = format.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            i += 1;
            continue;
        }
        i += 1;
        if bytes.get(i) == Some(&b'%') {
            i += 1;
            continue;
        }
        if bytes.get(i) == Some(&b'(') {
            while i < bytes.len() && bytes[i] != b')' {
                i += 1;
            }
            i += 1;
        }
        while i < bytes.len() && b"#0- +".contains(&bytes[i]) {
            i += 1;
        }
        i = check_number_at(bytes, i, "format width")?;
        if bytes.get(i) == Some(&b'.') {
            i = check_number_at(bytes, i + 1, "format precision")?;
        }
    }
    Ok(())
}

/// Every number in the format specifications (after the `:` of a `{...}`
/// field) of the `str.format` string `format`, checked against
/// [`ChatTemplate::MAX_FORMAT_WIDTH`].
fn check_str_format_widths(format: &str) -> std::result::Result<(), minijinja::Error> {
    let bytes = format.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'{' {
            i += 1;
            continue;
        }
        if bytes.get(i + 1) == Some(&b'{') {
            i += 2;
            continue;
        }
        let end = bytes[i..].iter().position(|&b| b == b'}').map_or(bytes.len(), |p| i + p);
        if let Some(colon) = bytes[i..end].iter().position(|&b| b == b':') {
            let mut j = i + colon + 1;
            while j < end {
                j = check_number_at(bytes, j, "format width or precision")?.max(j + 1);
            }
        }
        i = end;
    }
    Ok(())
}

/// Checks the decimal number starting at `bytes[at]` (if any) and returns
/// where it ends.
fn check_number_at(bytes: &[u8], at: usize, what: &str) -> std::result::Result<usize, minijinja::Error> {
    let digits = bytes[at.min(bytes.len())..].iter().take_while(|b| b.is_ascii_digit()).count();
    if digits > 0 {
        let n = bytes[at..at + digits]
            .iter()
            .fold(0u64, |n, &d| n.saturating_mul(10).saturating_add(u64::from(d - b'0')));
        check_width(n, what)?;
    }
    Ok(at + digits)
}

/// minijinja's `format` filter (printf style), its widths and precisions
/// bounded first.
pub(super) fn printf_format(
    state: &mut minijinja::State,
    format: &Value,
    args: Rest<ValueOrKwargs>,
) -> std::result::Result<Value, minijinja::Error> {
    if let Some(text) = format.as_str() {
        check_printf_widths(text)?;
    }
    minijinja::filters::format(state, format, args)
}

/// minijinja's `indent` filter, its width bounded first.
pub(super) fn indent(
    state: &minijinja::State,
    args: Rest<ValueOrKwargs>,
) -> std::result::Result<Value, minijinja::Error> {
    let args = args.into_values();
    let (value, width, first, blank, kwargs): (&Value, Option<usize>, Option<bool>, Option<bool>, Kwargs) =
        minijinja::value::from_args(&args)?;
    // A list or map's text within the fuel (not built whole first).
    let value = StringInput::new(state, value)?;
    let requested = match width {
        Some(width) => width,
        None => kwargs.peek::<Option<usize>>("width")?.unwrap_or(4),
    };
    check_width(requested as u64, "indent")?;
    // The result is charged once it exists; its size is paid for before it
    // is made, as minijinja's own `indent` does.
    let text = value.as_str();
    let lines = text.bytes().filter(|&b| b == b'\n').count() + 1;
    state.consume_fuel((requested.saturating_mul(lines).saturating_add(text.len()) / 64) as u64)?;
    minijinja::filters::indent(value, width, first, blank, kwargs)
}

/// Python's string, list and dict methods as jinja2 exposes them
/// (minijinja-contrib's), the widths of `str.format` bounded first.
pub(super) fn python_method(
    state: &mut minijinja::State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, minijinja::Error> {
    if method == "format" {
        if let Some(text) = value.as_str() {
            check_str_format_widths(text)?;
        }
        // A list or map argument's text is formatted once within the fuel
        // first: refused before the whole of it is built.
        for arg in args {
            let values: Vec<Value> = if arg.is_kwargs() {
                arg.try_iter()?.filter_map(|k| arg.get_item(&k).ok()).collect()
            } else {
                vec![arg.clone()]
            };
            for v in values.iter().filter(|v| v.as_object().is_some()) {
                StringInput::new(state, v)?;
            }
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}
