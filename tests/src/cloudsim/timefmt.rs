//! ISO 8601 timestamps as OpenStack prints them, without a date crate.

use std::time::{SystemTime, UNIX_EPOCH};

/// The precision OpenStack uses in a given field.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Style {
    /// Nova's `created`/`updated`: `2017-02-14T19:23:58Z`.
    Seconds,
    /// Keystone's `expires_at`/`issued_at`: `2015-11-09T01:42:57.527363Z`.
    Micros,
    /// Nova's `OS-SRV-USG:launched_at`: `2017-02-14T19:23:59.895661` (no zone).
    MicrosNaive,
}

/// Format `t` (UTC) in the given style.
pub(crate) fn iso8601(t: SystemTime, style: Style) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, day) = civil_from_days(days);
    let (hh, mm, ss) = (sod / 3600, (sod % 3600) / 60, sod % 60);
    let base = format!("{y:04}-{m:02}-{day:02}T{hh:02}:{mm:02}:{ss:02}");
    match style {
        Style::Seconds => format!("{base}Z"),
        Style::Micros => format!("{base}.{:06}Z", d.subsec_micros()),
        Style::MicrosNaive => format!("{base}.{:06}", d.subsec_micros()),
    }
}

/// Howard Hinnant's days-to-civil conversion (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m as u32, d as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn formats_known_instants() {
        let t = UNIX_EPOCH + Duration::from_micros(1_447_033_377_527_363);
        assert_eq!(iso8601(t, Style::Micros), "2015-11-09T01:42:57.527363Z");
        assert_eq!(iso8601(t, Style::Seconds), "2015-11-09T01:42:57Z");
        assert_eq!(iso8601(UNIX_EPOCH, Style::Seconds), "1970-01-01T00:00:00Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(iso8601(leap, Style::Seconds), "2000-02-29T00:00:00Z");
    }
}
