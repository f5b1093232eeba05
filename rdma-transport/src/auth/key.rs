//! The cluster key: at least 32 random bytes, hex-encoded in a file that only
//! its owner (and group) may read. Every member of a cluster holds it; the
//! handshake proves possession of it without ever sending it.

use std::fmt;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Fewest key bytes accepted.
pub const MIN_KEY_BYTES: usize = 32;
/// Most key bytes accepted (a file is not a place for anything bigger).
const MAX_KEY_BYTES: usize = 1024;

/// Why a cluster key could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The file could not be read.
    #[error("cannot read the cluster key file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// Other users may read the file.
    #[error(
        "the cluster key file {path} can be read by other users (mode {mode:o}): \
         run `chmod 600 {path}`"
    )]
    WorldReadable {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The contents are not hex.
    #[error("the cluster key is not hex-encoded ({0}); make one with `openssl rand -hex 32`")]
    NotHex(String),
    /// Too few (or too many) bytes.
    #[error(
        "the cluster key has {0} bytes; it needs {MIN_KEY_BYTES} to {MAX_KEY_BYTES} \
         (`openssl rand -hex 32`)"
    )]
    BadLength(usize),
    /// No randomness for a generated key.
    #[error("no random bytes from the OS for a key: {0}")]
    Random(String),
}

/// A cluster's shared secret. `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterKey {
    bytes: Vec<u8>,
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterKey")
            .field("bytes", &self.bytes.len())
            .finish_non_exhaustive()
    }
}

impl ClusterKey {
    /// Loads the hex-encoded key in `path` (surrounding white space is
    /// ignored), refusing a file other users may read.
    ///
    /// # Errors
    /// [`KeyError`]: unreadable, world-readable, not hex, too short.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, KeyError> {
        let path = path.as_ref();
        let read_err = |source| KeyError::Read {
            path: path.to_owned(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(read_err)?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o004 != 0 {
            return Err(KeyError::WorldReadable {
                path: path.to_owned(),
                mode,
            });
        }
        let text = std::fs::read_to_string(path).map_err(read_err)?;
        Self::from_hex(text.trim())
    }

    /// A key from its hex encoding.
    ///
    /// # Errors
    /// [`KeyError::NotHex`], [`KeyError::BadLength`].
    pub fn from_hex(hex: &str) -> Result<Self, KeyError> {
        Self::from_bytes(decode_hex(hex)?)
    }

    /// A key from its raw bytes (e.g. handed over by an embedder).
    ///
    /// # Errors
    /// [`KeyError::BadLength`].
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Self, KeyError> {
        let bytes = bytes.into();
        if !(MIN_KEY_BYTES..=MAX_KEY_BYTES).contains(&bytes.len()) {
            return Err(KeyError::BadLength(bytes.len()));
        }
        Ok(Self { bytes })
    }

    /// A new random 32-byte key (a throw-away cluster, e.g. the bench's).
    ///
    /// # Errors
    /// [`KeyError::Random`] when the OS gives no random bytes.
    pub fn generate() -> Result<Self, KeyError> {
        let mut bytes = vec![0u8; MIN_KEY_BYTES];
        getrandom::getrandom(&mut bytes).map_err(|e| KeyError::Random(e.to_string()))?;
        Ok(Self { bytes })
    }

    /// The hex encoding (to write a key file).
    pub fn to_hex(&self) -> String {
        self.bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// What a binary runs with, from its `--cluster-key-file PATH` (or
/// `RT_CLUSTER_KEY_FILE`) and `--insecure` flags: the key, or `None` when
/// insecure was asked for explicitly.
///
/// # Errors
/// Neither flag (a binary never runs without a key by accident), both, or
/// a key file that [`ClusterKey::from_file`] refuses; the message says what
/// to do.
pub fn key_from_flags(path: Option<&Path>, insecure: bool) -> Result<Option<ClusterKey>, String> {
    match (path, insecure) {
        (Some(path), false) => ClusterKey::from_file(path)
            .map(Some)
            .map_err(|e| e.to_string()),
        (None, true) => Ok(None),
        (Some(_), true) => Err("--cluster-key-file and --insecure exclude each other".into()),
        (None, false) => Err(
            "no cluster key: give --cluster-key-file PATH (or RT_CLUSTER_KEY_FILE=PATH; make one \
             with `openssl rand -hex 32 > cluster.key && chmod 600 cluster.key`), or --insecure \
             to let anyone on the network read and write guest memory"
                .into(),
        ),
    }
}

fn decode_hex(hex: &str) -> Result<Vec<u8>, KeyError> {
    if hex.len() % 2 != 0 {
        return Err(KeyError::NotHex("odd number of digits".into()));
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        b'A'..=b'F' => Ok(c - b'A' + 10),
        _ => Err(KeyError::NotHex(format!(
            "'{}' is not a hex digit",
            c as char
        ))),
    };
    hex.as_bytes()
        .chunks_exact(2)
        .map(|pair| Ok(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_key(text: &str, mode: u32) -> tempfile::TempPath {
        let file = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(file.path(), text).expect("write");
        std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(mode))
            .expect("chmod");
        file.into_temp_path()
    }

    #[test]
    fn a_good_key_file_loads() {
        let key = ClusterKey::generate().expect("key");
        let path = write_key(&format!("{}\n", key.to_hex()), 0o600);
        assert_eq!(ClusterKey::from_file(&path).expect("loads"), key);
        assert!(!format!("{key:?}").contains(&key.to_hex()[..8]));
    }

    #[test]
    fn bad_key_files_are_refused_with_a_reason() {
        let hex64 = "ab".repeat(32);
        let world = write_key(&hex64, 0o644);
        assert!(matches!(
            ClusterKey::from_file(&world),
            Err(KeyError::WorldReadable { mode: 0o644, .. })
        ));
        let short = write_key(&"ab".repeat(16), 0o600);
        assert!(matches!(
            ClusterKey::from_file(&short),
            Err(KeyError::BadLength(16))
        ));
        let not_hex = write_key(&"zz".repeat(32), 0o600);
        assert!(matches!(
            ClusterKey::from_file(&not_hex),
            Err(KeyError::NotHex(_))
        ));
        assert!(matches!(
            ClusterKey::from_file("/nonexistent/cluster.key"),
            Err(KeyError::Read { .. })
        ));
        let msg = ClusterKey::from_file(&world).unwrap_err().to_string();
        assert!(msg.contains("chmod 600"), "{msg}");
    }

    #[test]
    fn raw_bytes_make_the_same_key_as_their_hex() {
        let key = ClusterKey::from_bytes([0xab; 32]).expect("32 bytes");
        assert_eq!(key, ClusterKey::from_hex(&"ab".repeat(32)).expect("hex"));
        assert!(matches!(
            ClusterKey::from_bytes([1; 31]),
            Err(KeyError::BadLength(31))
        ));
        assert!(ClusterKey::from_bytes(vec![1; 1025]).is_err());
    }
}
