//! The engine's `QWEN3_WGPU_*` environment variables: each names a choice
//! from a fixed list, and an unknown value is an `invalid_argument` error
//! naming the variable and the allowed values (never silently ignored).

use crate::error::{Error, Result};

/// The value of `name` in `allowed` (case-insensitive), for a setting
/// called `what` (an environment variable or a flag).
pub(crate) fn parse_choice<T: Copy>(what: &str, value: &str, allowed: &[(&str, T)]) -> Result<T> {
    let lower = value.to_ascii_lowercase();
    allowed.iter().find(|(n, _)| *n == lower).map(|(_, v)| *v).ok_or_else(|| {
        let names: Vec<&str> = allowed.iter().map(|(n, _)| *n).collect();
        Error::invalid_argument(what, format!("unknown value {value:?}; allowed: {}", names.join(", ")))
    })
}

/// The choice the environment variable `var` names: `None` when it is
/// unset or empty.
pub(crate) fn env_choice<T: Copy>(var: &str, allowed: &[(&str, T)]) -> Result<Option<T>> {
    match std::env::var(var) {
        Ok(v) if v.is_empty() => Ok(None),
        Ok(v) => parse_choice(var, &v, allowed).map(Some),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(Error::invalid_argument(var, "the value is not valid UTF-8"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_value_names_the_setting_and_the_allowed_values() {
        let allowed = [("rows", 1), ("split", 2)];
        assert_eq!(parse_choice("X", "SPLIT", &allowed).unwrap(), 2);
        let e = parse_choice("QWEN3_WGPU_MATVEC_LAYOUT", "colums", &allowed).unwrap_err();
        assert_eq!(e.code(), "invalid_argument");
        let msg = e.to_string();
        assert!(msg.contains("QWEN3_WGPU_MATVEC_LAYOUT") && msg.contains("rows, split"), "{msg}");
    }
}
