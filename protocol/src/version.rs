//! Protocol versions and their negotiation.
//!
//! A [`Version`] is `major.minor`. A minor bump is additive (new `Option` fields with
//! `#[serde(default)]` in the JSON handshake payloads, new message variants appended at the end of
//! the session enums); a major bump is breaking. Two peers talk at the highest major they share, at
//! the smaller of their two minors.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A protocol version, `major.minor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Version {
    /// Breaking changes bump the major version.
    pub major: u16,
    /// Additive changes bump the minor version.
    pub minor: u16,
}

/// The newest protocol version this crate speaks.
pub const PROTOCOL_VERSION: Version = Version { major: 1, minor: 3 };

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Formats a list of versions as `1.0, 2.1` for error messages.
pub fn list(versions: &[Version]) -> String {
    let names: Vec<String> = versions.iter().map(Version::to_string).collect();
    names.join(", ")
}

/// Picks the version two peers talk at: the highest major both speak, at the smaller of the two
/// minors. Each list holds, per major a peer speaks, the newest minor it speaks.
///
/// Returns `None` when the peers share no major version.
pub fn negotiate(ours: &[Version], theirs: &[Version]) -> Option<Version> {
    ours.iter()
        .filter_map(|a| {
            theirs
                .iter()
                .filter(|b| b.major == a.major)
                .map(|b| Version {
                    major: a.major,
                    minor: a.minor.min(b.minor),
                })
                .max()
        })
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn v(major: u16, minor: u16) -> Version {
        Version { major, minor }
    }

    #[test]
    fn picks_highest_shared_major_and_smaller_minor() {
        assert_eq!(negotiate(&[v(1, 3)], &[v(1, 1)]), Some(v(1, 1)));
        assert_eq!(negotiate(&[v(1, 0)], &[v(1, 4)]), Some(v(1, 0)));
        assert_eq!(
            negotiate(&[v(1, 2), v(2, 0)], &[v(1, 5), v(2, 3)]),
            Some(v(2, 0))
        );
        assert_eq!(
            negotiate(&[v(1, 2), v(2, 0)], &[v(1, 5), v(3, 0)]),
            Some(v(1, 2))
        );
    }

    #[test]
    fn no_shared_major_is_none() {
        assert_eq!(negotiate(&[v(1, 0)], &[v(2, 0), v(3, 1)]), None);
        assert_eq!(negotiate(&[v(1, 0)], &[]), None);
    }

    #[test]
    fn lists_and_displays() {
        assert_eq!(list(&[v(1, 0), v(2, 7)]), "1.0, 2.7");
        assert_eq!(PROTOCOL_VERSION.to_string(), "1.3");
    }
}
