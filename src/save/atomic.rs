//! Crash-safe writes: a file appears whole or not at all, and a directory is replaced in
//! one rename.

use crate::error::{Error, Result};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` through a temporary file in the same directory, flushed to
/// disk before it is renamed over `path`.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_sibling(path, "tmp");
    let result = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    result.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

/// Builds a directory beside its target and swaps it in by [`DirectoryWriter::commit`]:
/// until then the previous contents of the target stay untouched.
#[derive(Debug)]
pub struct DirectoryWriter {
    target: PathBuf,
    staging: PathBuf,
}

impl DirectoryWriter {
    /// Starts writing `target` (its parent directories are created).
    pub fn new(target: &Path) -> Result<Self> {
        if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        let staging = temp_sibling(target, "partial");
        if staging.exists() {
            fs::remove_dir_all(&staging).map_err(|e| Error::io(&staging, e))?;
        }
        fs::create_dir(&staging).map_err(|e| Error::io(&staging, e))?;
        Ok(DirectoryWriter {
            target: target.to_path_buf(),
            staging,
        })
    }

    /// Where to write the file called `name`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.staging.join(name)
    }

    /// Writes the file called `name`.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<()> {
        write_atomically(&self.path(name), bytes)
    }

    /// Replaces the target with what was written: the old target is moved aside, the new
    /// one renamed in, then the old one removed. Files in the old target that this writer
    /// did not produce (a user's notes, a tokenizer) are carried over.
    pub fn commit(self) -> Result<()> {
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |e| Error::io(p, e)
        };
        if self.target.is_dir() {
            for entry in fs::read_dir(&self.target).map_err(io(&self.target))? {
                let entry = entry.map_err(io(&self.target))?;
                let dest = self.staging.join(entry.file_name());
                if !dest.exists() && entry.file_type().map_err(io(&entry.path()))?.is_file() {
                    fs::copy(entry.path(), &dest).map_err(io(&dest))?;
                }
            }
            let old = temp_sibling(&self.target, "old");
            if old.exists() {
                fs::remove_dir_all(&old).map_err(io(&old))?;
            }
            fs::rename(&self.target, &old).map_err(io(&self.target))?;
            fs::rename(&self.staging, &self.target).map_err(io(&self.target))?;
            fs::remove_dir_all(&old).map_err(io(&old))?;
        } else {
            if self.target.exists() {
                return Err(Error::data(
                    self.target.display().to_string(),
                    "exists and is not a directory; choose another output directory",
                ));
            }
            fs::rename(&self.staging, &self.target).map_err(io(&self.target))?;
        }
        Ok(())
    }
}

/// `dir/.name.suffix` beside `path`, unique to this process.
fn temp_sibling(path: &Path, suffix: &str) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    path.with_file_name(format!(".{name}.{}.{suffix}", std::process::id()))
}
