//! One error type for the whole engine. `python.rs` maps each variant to one class of the
//! `colibri.errors` hierarchy, so the variant chosen here decides what a Python user catches.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An operating-system I/O failure on a named file.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `config.json` (or another JSON sidecar) is missing a field or has a bad value.
    #[error("{}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },
    /// A model family or feature that colibri does not implement.
    #[error("{0}")]
    Unsupported(String),
    /// A container file is corrupt, truncated or inconsistent with the config.
    #[error("{}{}: {msg}", file.display(), tensor.as_ref().map(|t| format!(" (tensor '{t}')")).unwrap_or_default())]
    Container {
        file: PathBuf,
        tensor: Option<String>,
        msg: String,
    },
    /// A tensor the model needs is absent from every shard.
    #[error("tensor '{tensor}' not found in any *.safetensors shard of {}; the checkpoint is incomplete or is not a {family} model", dir.display())]
    MissingTensor {
        tensor: String,
        dir: PathBuf,
        family: String,
    },
    /// A caller-supplied parameter is out of range.
    #[error("invalid value for '{param}': {msg}")]
    InvalidArgument { param: String, msg: String },
    /// The source weights of a conversion contain NaN or Inf.
    #[error("tensor '{tensor}' contains {what} at flat index {index}; refusing to quantise it")]
    NonFinite {
        tensor: String,
        what: &'static str,
        index: usize,
    },
    /// A stored weight (data, scales, norm, router, bias) holds NaN/Inf or a magnitude no
    /// trained weight has; found when the tensor is loaded.
    #[error(
        "{} (tensor '{tensor}'): holds {what} at flat index {index}; the checkpoint is \
         damaged or was exported with bad values: download or convert it again",
        file.display()
    )]
    NonFiniteWeight {
        file: PathBuf,
        tensor: String,
        what: String,
        index: usize,
    },
    /// The model computed a NaN or infinite logit: its weights hold NaN/Inf, or produce it.
    /// The message says which logit and, where a bounded scan found it, which tensor.
    #[error("{0}")]
    NonFiniteOutput(String),
    /// A saved context (a session's KV written by `Session::save`) is truncated, corrupt, of
    /// another format version, or was made by another model.
    #[error("{}: {msg}", path.display())]
    SavedContext { path: PathBuf, msg: String },
    /// The caller asked the running operation to stop (Ctrl-C).
    #[error("cancelled")]
    Cancelled,
    /// The engine was created in another process and this one is a fork of it: its I/O and
    /// compute threads did not survive the fork, so it cannot run here.
    #[error(
        "this model was loaded in process {created_in} and this is a forked child (pid \
         {current}); its I/O and compute threads do not survive fork(). Load the model in the \
         child, or use multiprocessing's 'spawn' or 'forkserver' start method"
    )]
    ForkedProcess { created_in: u32, current: u32 },
    /// A bug in colibri (including a caught panic): please report it.
    #[error("internal error: {0} (this is a colibri bug; please report it)")]
    Internal(String),
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub fn container(
        file: impl Into<PathBuf>,
        tensor: Option<&str>,
        msg: impl Into<String>,
    ) -> Self {
        Error::Container {
            file: file.into(),
            tensor: tensor.map(str::to_owned),
            msg: msg.into(),
        }
    }

    pub fn saved_context(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::SavedContext {
            path: path.into(),
            msg: msg.into(),
        }
    }

    pub fn invalid(param: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::InvalidArgument {
            param: param.into(),
            msg: msg.into(),
        }
    }
}
