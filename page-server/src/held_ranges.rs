//! The ranges whose contents this node's memory has held, kept in a file
//! of its state directory (`--state-dir`) so that they outlive the process.
//!
//! A page-server keeps guest pages only in RAM: a new process starts with
//! zeros. A coordinator that kept its state knows the range was held in an
//! older epoch and serves nothing from the new one (`lost`). But a
//! coordinator that lost its state too only has the claim to go by, and a
//! claim that says nothing makes a range new, `live` with zeros. With this
//! file, a process that finds a range in it claims `missed` instead: the
//! range is `lost` and clients get `DataLost`, never those zeros, until
//! another replica that holds it claims it or the operator re-initialises
//! it (docs/operations.md, "Coordinator state lost").

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// The file's name in the state directory.
pub(crate) const FILE_NAME: &str = "held-ranges.json";

/// One range, as the coordinator names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HeldRange {
    pub(crate) gpa_start: u64,
    pub(crate) length_bytes: u64,
}

/// What the file holds.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileBody {
    /// The node whose memory held them: a directory is one node's.
    node_id: String,
    ranges: Vec<HeldRange>,
}

/// Why the state directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StateDirError {
    /// The directory or its file cannot be read or created.
    #[error("{path}: {source}")]
    Io {
        /// The directory or file.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The file is not what this release writes.
    #[error("{path}: not a held-ranges file: {reason}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// The parse error.
        reason: String,
    },
    /// The directory is another node's.
    #[error("{path} is node {found:?}'s state, not {expected:?}'s")]
    OtherNode {
        /// The file.
        path: PathBuf,
        /// Its node.
        found: String,
        /// This node.
        expected: String,
    },
}

/// The file, and what it says.
#[derive(Debug)]
pub(crate) struct HeldRanges {
    path: PathBuf,
    node_id: String,
    ranges: Mutex<Vec<HeldRange>>,
}

impl HeldRanges {
    /// Opens `dir` (created when missing) for `node_id`. A missing file is
    /// no range held; an unreadable or malformed one, or another node's,
    /// is an error: taken as empty, it would let zeros pass for the
    /// ranges it names.
    pub(crate) fn open(dir: &Path, node_id: &str) -> Result<Self, StateDirError> {
        fs::create_dir_all(dir).map_err(|source| StateDirError::Io {
            path: dir.to_owned(),
            source,
        })?;
        let path = dir.join(FILE_NAME);
        let ranges = match fs::read(&path) {
            Ok(bytes) => {
                let body: FileBody =
                    serde_json::from_slice(&bytes).map_err(|err| StateDirError::Malformed {
                        path: path.clone(),
                        reason: err.to_string(),
                    })?;
                if body.node_id != node_id {
                    return Err(StateDirError::OtherNode {
                        path,
                        found: body.node_id,
                        expected: node_id.to_owned(),
                    });
                }
                body.ranges
            }
            Err(err) if err.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(source) => return Err(StateDirError::Io { path, source }),
        };
        Ok(Self {
            path,
            node_id: node_id.to_owned(),
            ranges: Mutex::new(ranges),
        })
    }

    /// Whether an earlier process (or this one) held `range`.
    pub(crate) fn contains(&self, range: HeldRange) -> bool {
        self.ranges.lock().contains(&range)
    }

    /// Records that this process's memory holds `range`, on disk before it
    /// returns (nothing is written when it is there already). On an error
    /// the range is not recorded and the next call tries again.
    pub(crate) fn record(&self, range: HeldRange) -> Result<(), StateDirError> {
        let mut ranges = self.ranges.lock();
        if ranges.contains(&range) {
            return Ok(());
        }
        let mut next = ranges.clone();
        next.push(range);
        let body = FileBody {
            node_id: self.node_id.clone(),
            ranges: next,
        };
        self.replace_file(&body)
            .map_err(|source| StateDirError::Io {
                path: self.path.clone(),
                source,
            })?;
        *ranges = body.ranges;
        Ok(())
    }

    /// The new file before it replaces the old one: named by this process,
    /// so that two processes of one node never write into the same one.
    fn temporary_path(&self) -> PathBuf {
        self.path
            .with_file_name(format!("{FILE_NAME}.{}.new", std::process::id()))
    }

    /// Writes `body` to a new file, syncs it, renames it over the old one
    /// and syncs the directory: a crash leaves the old file or the new one.
    fn replace_file(&self, body: &FileBody) -> io::Result<()> {
        let json = serde_json::to_vec_pretty(body).map_err(io::Error::other)?;
        let temporary = self.temporary_path();
        let mut file = fs::File::create(&temporary)?;
        file.write_all(&json)?;
        file.sync_all()?;
        drop(file);
        fs::rename(&temporary, &self.path)?;
        if let Some(dir) = self.path.parent() {
            fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: HeldRange = HeldRange {
        gpa_start: 0,
        length_bytes: 1 << 20,
    };
    const B: HeldRange = HeldRange {
        gpa_start: 1 << 20,
        length_bytes: 4096,
    };

    #[test]
    fn a_recorded_range_is_there_for_the_next_process() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let first = HeldRanges::open(&state, "n1").unwrap();
        assert!(!first.contains(A));
        first.record(A).unwrap();
        first.record(A).unwrap();
        assert!(first.contains(A));
        drop(first);

        let next = HeldRanges::open(&state, "n1").unwrap();
        assert!(next.contains(A));
        assert!(!next.contains(B), "only what was recorded");
        // Same start, other length: another range.
        assert!(!next.contains(HeldRange {
            length_bytes: 8192,
            ..A
        }));
        next.record(B).unwrap();
        let text = fs::read_to_string(state.join(FILE_NAME)).unwrap();
        let body: FileBody = serde_json::from_str(&text).unwrap();
        assert_eq!(body.node_id, "n1");
        assert_eq!(body.ranges, [A, B]);
        assert!(!next.temporary_path().exists());
    }

    #[test]
    fn a_malformed_file_or_another_nodes_is_refused_not_taken_as_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        for bad in [
            &b""[..],
            b"{\"node_id\":\"n1\"}",
            b"{\"node_id\":\"n1\",\"ranges\":[{\"gpa_start\":-1,\"length_bytes\":1}]}",
            b"{\"node_id\":\"n1\",\"ranges\":[],\"extra\":1}",
            b"\xff\xfe",
        ] {
            fs::write(&path, bad).unwrap();
            let err = HeldRanges::open(dir.path(), "n1").unwrap_err();
            assert!(
                matches!(err, StateDirError::Malformed { .. }),
                "{:?}: {err}",
                String::from_utf8_lossy(bad)
            );
        }
        let ours = HeldRanges::open(&dir.path().join("n2"), "n2").unwrap();
        ours.record(A).unwrap();
        let err = HeldRanges::open(&dir.path().join("n2"), "n3").unwrap_err();
        assert!(
            err.to_string()
                .contains("node \"n2\"'s state, not \"n3\"'s"),
            "{err}"
        );
    }

    #[test]
    fn a_failed_write_records_nothing_and_the_next_one_retries() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let held = HeldRanges::open(&state, "n1").unwrap();
        // The temporary file's name taken by a directory: the write fails.
        fs::create_dir(held.temporary_path()).unwrap();
        assert!(matches!(held.record(A), Err(StateDirError::Io { .. })));
        assert!(!held.contains(A));
        assert!(!state.join(FILE_NAME).exists());
        fs::remove_dir(held.temporary_path()).unwrap();
        held.record(A).unwrap();
        assert!(HeldRanges::open(&state, "n1").unwrap().contains(A));
    }
}
