//! The one error type of trainkit: every failure says what went wrong and what would fix it.

use std::path::PathBuf;

/// Result with trainkit's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in trainkit, each variant carrying enough context to act on.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is invalid: names the field, the value and what would be valid.
    #[error("invalid config `{field}`: {message}")]
    Config {
        /// Dotted path of the offending field, e.g. `model.n_head`.
        field: String,
        /// What is wrong and what would be valid.
        message: String,
    },
    /// Two tensors (or a tensor and an op) disagree about shapes or dtypes.
    #[error("shape error in {op}: {message}")]
    Shape {
        /// The op that found the mismatch.
        op: &'static str,
        /// The shapes involved and what was expected.
        message: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Input data (a token file, a text file, a checkpoint) is malformed.
    #[error("bad data in {what}: {message}")]
    Data {
        /// Which input is malformed.
        what: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// A backend could not run an op (device missing, allocation failure, ...).
    #[error("{backend} backend: {message}")]
    Backend {
        /// Backend name (`cpu`, `cuda`).
        backend: &'static str,
        /// What failed.
        message: String,
    },
    /// A memory limit was exceeded.
    #[error("out of memory: {message}")]
    OutOfMemory {
        /// Request, limit, and what was live.
        message: String,
    },
    /// Training diverged: too many consecutive steps with a non-finite loss or gradient.
    #[error("training diverged: {message}")]
    Diverged {
        /// What happened and what to try.
        message: String,
    },
    /// Serialization or deserialization failed.
    #[error("{0}")]
    Serde(String),
}

impl Error {
    /// A config error for `field`.
    pub fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Config {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The same error, a config error naming `field` instead of its own (a flag that
    /// carries a value checked elsewhere); other errors unchanged.
    pub fn for_field(self, field: impl Into<String>) -> Self {
        match self {
            Error::Config { message, .. } => Error::Config {
                field: field.into(),
                message,
            },
            other => other,
        }
    }

    /// A shape error found by `op`.
    pub fn shape(op: &'static str, message: impl Into<String>) -> Self {
        Error::Shape {
            op,
            message: message.into(),
        }
    }

    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// A data error in `what`.
    pub fn data(what: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Data {
            what: what.into(),
            message: message.into(),
        }
    }
}
