//! What the machine is and how much memory a process peaked at, from `/proc`.

use serde::{Deserialize, Serialize};

/// The machine a run was measured on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// CPU model name.
    pub cpu: String,
    /// Logical CPUs the OS reports.
    pub logical_cpus: usize,
    /// Total memory, GiB.
    pub mem_gib: f64,
    /// One-minute load average when the run started: above ~0.5 the numbers were taken under load.
    pub loadavg_start: f64,
    /// One-minute load average when it ended.
    pub loadavg_end: f64,
}

impl Machine {
    /// Reads `/proc/cpuinfo`, `/proc/meminfo` and `/proc/loadavg` (empty fields where absent).
    pub fn probe() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = field(&cpuinfo, "model name")
            .unwrap_or("unknown")
            .to_string();
        let logical_cpus = cpuinfo
            .lines()
            .filter(|l| l.starts_with("processor"))
            .count();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let mem_kb = field(&meminfo, "MemTotal").and_then(kb).unwrap_or(0);
        Machine {
            cpu,
            logical_cpus,
            mem_gib: mem_kb as f64 / (1024.0 * 1024.0),
            loadavg_start: loadavg(),
            loadavg_end: 0.0,
        }
    }
}

/// The one-minute load average (0 where unknown).
pub fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// Now in UTC as `YYYY-MM-DDTHH:MM:SSZ` (no time zone database needed).
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    utc_stamp(secs)
}

/// Seconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_stamp(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Peak resident set (`VmHWM`) of `pid`, or of this process for `None`, in kB.
pub fn peak_rss_kb(pid: Option<u32>) -> Option<u64> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/status"),
        None => "/proc/self/status".to_string(),
    };
    let status = std::fs::read_to_string(path).ok()?;
    field(&status, "VmHWM").and_then(kb)
}

/// The value of `key: value` in a `/proc` file.
fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == key).then(|| v.trim())
    })
}

/// `"1234 kB"` → 1234.
fn kb(value: &str) -> Option<u64> {
    value.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_fields_and_own_peak_rss() {
        assert_eq!(
            field("Name:\tx\nVmHWM:\t  2048 kB\n", "VmHWM").and_then(kb),
            Some(2048)
        );
        assert_eq!(field("VmHWMx: 1 kB", "VmHWM"), None);
        // This test process has touched at least a megabyte.
        let own = peak_rss_kb(None).expect("Linux /proc");
        assert!(own > 1024, "{own}");
        let m = Machine::probe();
        assert_eq!(utc_stamp(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_stamp(951_782_400 + 3661), "2000-02-29T01:01:01Z");
        assert!(m.logical_cpus >= 1 && m.mem_gib > 0.0, "{m:?}");
    }
}
