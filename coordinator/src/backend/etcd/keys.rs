//! The etcd key layout under the configured prefix:
//!
//! | key | value | |
//! | --- | --- | --- |
//! | `<prefix>version` | empty | rewritten by every map change: its mod revision is the map version |
//! | `<prefix>generation` | decimal `u64` | written once, by the first coordinator on the prefix: the generation of its versions |
//! | `<prefix>nodes/<id>` | [`NodeValue`] JSON | a registered node |
//! | `<prefix>alive/<id>` | [`AliveValue`] JSON | attached to the node's lease: gone when it expires |
//! | `<prefix>ranges/<gpa_start, 16 hex digits>` | [`RangeValue`] JSON | a range with its replicas |
//!
//! Node ids are validated (`[A-Za-z0-9_.-]`), so they never contain `/`.
//! Fixed-width hex keeps the ranges in address order.
//!
//! [`NodeValue`]: super::model::NodeValue
//! [`AliveValue`]: super::model::AliveValue
//! [`RangeValue`]: super::model::RangeValue

/// Builds and parses the keys of one prefix.
#[derive(Debug, Clone)]
pub(super) struct Keys {
    prefix: String,
}

/// What a key under the prefix names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Key<'a> {
    Version,
    Generation,
    Node(&'a str),
    Alive(&'a str),
    Range(u64),
}

impl Keys {
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
        }
    }

    /// The prefix every key starts with.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn version(&self) -> String {
        format!("{}version", self.prefix)
    }

    pub fn generation(&self) -> String {
        format!("{}generation", self.prefix)
    }

    pub fn node(&self, id: &str) -> String {
        format!("{}nodes/{id}", self.prefix)
    }

    pub fn alive(&self, id: &str) -> String {
        format!("{}alive/{id}", self.prefix)
    }

    pub fn range(&self, gpa_start: u64) -> String {
        format!("{}ranges/{gpa_start:016x}", self.prefix)
    }

    /// What `key` names; `None` for a key this version does not know.
    pub fn parse<'a>(&self, key: &'a str) -> Option<Key<'a>> {
        let rest = key.strip_prefix(self.prefix.as_str())?;
        if rest == "version" {
            return Some(Key::Version);
        }
        if rest == "generation" {
            return Some(Key::Generation);
        }
        if let Some(id) = rest.strip_prefix("nodes/") {
            return Some(Key::Node(id));
        }
        if let Some(id) = rest.strip_prefix("alive/") {
            return Some(Key::Alive(id));
        }
        let hex = rest.strip_prefix("ranges/")?;
        if hex.len() != 16 {
            return None;
        }
        u64::from_str_radix(hex, 16).ok().map(Key::Range)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_sort_by_address() {
        let keys = Keys::new("/p/");
        assert_eq!(keys.parse(&keys.version()), Some(Key::Version));
        assert_eq!(keys.parse(&keys.generation()), Some(Key::Generation));
        assert_eq!(keys.parse(&keys.node("a.b")), Some(Key::Node("a.b")));
        assert_eq!(keys.parse(&keys.alive("a")), Some(Key::Alive("a")));
        assert_eq!(
            keys.parse(&keys.range(u64::MAX)),
            Some(Key::Range(u64::MAX))
        );
        assert!(keys.range(0x1000) < keys.range(0x2_0000_0000));
        assert_eq!(keys.parse("/p/ranges/12"), None);
        assert_eq!(keys.parse("/q/version"), None);
        assert_eq!(keys.parse("/p/other"), None);
    }
}
