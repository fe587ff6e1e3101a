//! The functions transformers gives chat templates: `raise_exception` and
//! `strftime_now`.

use minijinja::{ErrorKind, Value};

/// The error `raise_exception` attaches, to tell it from other failures.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

pub(super) fn raised_message(e: &minijinja::Error) -> Option<String> {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(raised) = s.downcast_ref::<Raised>() {
            return Some(raised.0.clone());
        }
        source = s.source();
    }
    None
}

/// transformers' `raise_exception(message)`: fails the render with the
/// template's message.
pub(super) fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

/// transformers' `strftime_now(format)`: the current time, formatted. UTC
/// (transformers uses the host's local time zone).
pub(super) fn strftime_now(format: String) -> std::result::Result<Value, minijinja::Error> {
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
    strftime(&format, now as i64).map(Value::from)
}

/// Formats `unix_seconds` (UTC) with the C `strftime` specifiers chat
/// templates use.
pub(super) fn strftime(format: &str, unix_seconds: i64) -> std::result::Result<String, minijinja::Error> {
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let spec = chars.next().unwrap_or('%');
        let month_name = MONTHS[(month - 1) as usize];
        match spec {
            'Y' => out += &year.to_string(),
            'y' => out += &format!("{:02}", year.rem_euclid(100)),
            'm' => out += &format!("{month:02}"),
            'd' => out += &format!("{day:02}"),
            'e' => out += &format!("{day:2}"),
            'j' => out += &format!("{day_of_year:03}"),
            'H' => out += &format!("{hour:02}"),
            'I' => out += &format!("{:02}", (hour + 11) % 12 + 1),
            'p' => out += if hour < 12 { "AM" } else { "PM" },
            'M' => out += &format!("{minute:02}"),
            'S' => out += &format!("{second:02}"),
            'B' => out += month_name,
            'b' | 'h' => out += &month_name[..3],
            'A' => out += DAYS[weekday],
            'a' => out += &DAYS[weekday][..3],
            'F' => out += &format!("{year}-{month:02}-{day:02}"),
            'T' => out += &format!("{hour:02}:{minute:02}:{second:02}"),
            '%' => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported format %{other}"),
                ))
            }
        }
    }
    Ok(out)
}

/// (year, month, day) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}
