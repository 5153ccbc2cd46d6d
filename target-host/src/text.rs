//! Generated ids → text deltas that are safe to show: no half UTF-8 characters and no prefix of
//! a stop string that may still complete.

/// Finds stop strings in generated text and decides how much of it may be shown yet.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
}

/// Where a stop string was found, or how much text is safe to emit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopScan {
    /// A stop string starts at this byte offset: the text ends there.
    Stopped(usize),
    /// Nothing matched; text up to this byte offset can never become part of a stop string.
    SafeUpTo(usize),
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
        }
    }

    /// Scans `text`, of which the first `checked` bytes were scanned before (a stop string
    /// may still start up to its length before `checked`).
    pub fn scan(&self, text: &str, checked: usize) -> StopScan {
        let mut first: Option<usize> = None;
        for stop in &self.stops {
            let from = floor_char_boundary(text, checked.saturating_sub(stop.len() - 1));
            if let Some(i) = text[from..].find(stop.as_str()) {
                first = Some(first.map_or(from + i, |f| f.min(from + i)));
            }
        }
        if let Some(at) = first {
            return StopScan::Stopped(at);
        }
        // Hold back the longest suffix of `text` that is a proper prefix of some stop string.
        let mut hold = 0;
        for stop in &self.stops {
            for (len, _) in stop.char_indices().skip(1) {
                if len > hold && text.ends_with(&stop[..len]) {
                    hold = len;
                }
            }
        }
        StopScan::SafeUpTo(text.len() - hold)
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn finds_a_stop_across_deltas() {
        let m = matcher(&["END"]);
        assert_eq!(m.scan("abc E", 0), StopScan::SafeUpTo(4));
        assert_eq!(m.scan("abc EN", 5), StopScan::SafeUpTo(4));
        assert_eq!(m.scan("abc ENDx", 6), StopScan::Stopped(4));
    }

    #[test]
    fn earliest_stop_wins_and_unicode_is_safe() {
        let m = matcher(&["é!", "b"]);
        assert_eq!(m.scan("aébé!", 0), StopScan::Stopped(3));
        assert_eq!(matcher(&["é!"]).scan("aaé", 2), StopScan::SafeUpTo(2));
    }

    #[test]
    fn no_stops_means_everything_is_safe() {
        assert_eq!(matcher(&[]).scan("hello", 0), StopScan::SafeUpTo(5));
    }
}
