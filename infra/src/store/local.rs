//! `file://` store: the embedded default. Atomic puts write a temporary file in the
//! target folder, fsync it, then rename it over the key; `put_if_absent` links the
//! temporary file to the key, which fails if the key exists (exactly one winner).

use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use bytes::Bytes;
use tempfile::NamedTempFile;

use super::{check_key, check_prefix, MultipartUpload, ObjectMeta, ObjectStore, PutOutcome, Result, StoreError};

/// Prefix of temporary files; `list` never shows them.
const TMP_PREFIX: &str = ".hs-tmp-";

/// An object store in a local folder.
#[derive(Debug, Clone)]
pub struct LocalStore {
    root: PathBuf,
}

impl LocalStore {
    /// Opens the folder `root`. Nothing is created until the first write (reading a store
    /// that is not there creates nothing); a file in its place is an error.
    pub fn new(root: impl AsRef<Path>) -> Result<Self> {
        let root = root.as_ref().to_path_buf();
        if root.exists() && !root.is_dir() {
            let source = std::io::Error::new(std::io::ErrorKind::NotADirectory, "is a file, not a store folder");
            return Err(StoreError::Io { path: root.display().to_string(), source });
        }
        Ok(LocalStore { root })
    }

    /// The folder this store writes to.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, key: &str) -> Result<PathBuf> {
        check_key(key)?;
        Ok(self.root.join(key))
    }

    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
        move |source| StoreError::Io { path: path.display().to_string(), source }
    }

    fn temp_in(path: &Path) -> Result<NamedTempFile> {
        let parent = path.parent().expect("keys have a parent folder");
        std::fs::create_dir_all(parent).map_err(Self::io(parent))?;
        let mut builder = tempfile::Builder::new();
        builder.prefix(TMP_PREFIX);
        // Stored objects are readable by the group and others, as files written with the
        // usual umask are (a temporary file alone would be 0600): a checkpoint folder is
        // loaded by serving processes running as other users.
        #[cfg(unix)]
        builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644));
        builder.tempfile_in(parent).map_err(Self::io(parent))
    }

    fn write_temp(path: &Path, bytes: &[u8]) -> Result<NamedTempFile> {
        let mut tmp = Self::temp_in(path)?;
        tmp.write_all(bytes).map_err(Self::io(path))?;
        tmp.as_file().sync_all().map_err(Self::io(path))?;
        Ok(tmp)
    }

    fn not_found_or(&self, key: &str, path: &Path, e: std::io::Error) -> StoreError {
        if e.kind() == std::io::ErrorKind::NotFound {
            StoreError::NotFound { url: self.object_url(key) }
        } else {
            StoreError::Io { path: path.display().to_string(), source: e }
        }
    }
}

fn sync_parent(path: &Path) {
    // Make the rename durable; failure to open a folder for fsync is not fatal on every OS.
    if let Some(parent) = path.parent() {
        if let Ok(dir) = std::fs::File::open(parent) {
            let _ = dir.sync_all();
        }
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.expect("store IO tasks do not panic")
}

#[async_trait]
impl ObjectStore for LocalStore {
    fn url(&self) -> String {
        format!("file://{}", self.root.display())
    }

    fn object_url(&self, key: &str) -> String {
        format!("file://{}", self.root.join(key).display())
    }

    fn folder_url(&self, prefix: &str) -> String {
        format!("file://{}", self.root.join(prefix.trim_matches('/')).display())
    }

    async fn put(&self, key: &str, bytes: Bytes) -> Result<()> {
        let path = self.path(key)?;
        blocking(move || {
            let tmp = Self::write_temp(&path, &bytes)?;
            tmp.persist(&path).map_err(|e| StoreError::Io { path: path.display().to_string(), source: e.error })?;
            sync_parent(&path);
            Ok(())
        })
        .await
    }

    async fn put_if_absent(&self, key: &str, bytes: Bytes) -> Result<PutOutcome> {
        let path = self.path(key)?;
        blocking(move || {
            let tmp = Self::write_temp(&path, &bytes)?;
            match tmp.persist_noclobber(&path) {
                Ok(_) => {
                    sync_parent(&path);
                    Ok(PutOutcome::Created)
                }
                Err(e) if e.error.kind() == std::io::ErrorKind::AlreadyExists => Ok(PutOutcome::AlreadyExists),
                Err(e) => Err(StoreError::Io { path: path.display().to_string(), source: e.error }),
            }
        })
        .await
    }

    async fn get(&self, key: &str) -> Result<Bytes> {
        let path = self.path(key)?;
        match tokio::fs::read(&path).await {
            Ok(v) => Ok(Bytes::from(v)),
            Err(e) => Err(self.not_found_or(key, &path, e)),
        }
    }

    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        use tokio::io::{AsyncReadExt, AsyncSeekExt};
        let path = self.path(key)?;
        let mut file = tokio::fs::File::open(&path).await.map_err(|e| self.not_found_or(key, &path, e))?;
        file.seek(std::io::SeekFrom::Start(range.start)).await.map_err(Self::io(&path))?;
        let mut buf = vec![0u8; (range.end.saturating_sub(range.start)) as usize];
        file.read_exact(&mut buf).await.map_err(Self::io(&path))?;
        Ok(Bytes::from(buf))
    }

    async fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
        let path = self.path(key)?;
        match tokio::fs::metadata(&path).await {
            Ok(m) if m.is_file() => Ok(Some(ObjectMeta { key: key.to_string(), size: m.len() })),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::Io { path: path.display().to_string(), source: e }),
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        check_prefix(prefix)?;
        let root = self.root.clone();
        let prefix = prefix.to_string();
        blocking(move || {
            // Walk only the deepest folder the prefix fully names.
            let start_rel = match prefix.rfind('/') {
                Some(i) => &prefix[..i],
                None => "",
            };
            let mut out = Vec::new();
            let mut stack = vec![root.join(start_rel)];
            while let Some(dir) = stack.pop() {
                let entries = match std::fs::read_dir(&dir) {
                    Ok(e) => e,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(StoreError::Io { path: dir.display().to_string(), source: e }),
                };
                for entry in entries {
                    let entry = entry.map_err(Self::io(&dir))?;
                    let name = entry.file_name();
                    if name.to_string_lossy().starts_with(TMP_PREFIX) {
                        continue;
                    }
                    let path = entry.path();
                    let ft = entry.file_type().map_err(Self::io(&path))?;
                    if ft.is_dir() {
                        stack.push(path);
                    } else if ft.is_file() {
                        let rel = path.strip_prefix(&root).expect("walk stays under the root");
                        let key = rel.to_string_lossy().replace('\\', "/");
                        if key.starts_with(&prefix) {
                            let size = entry.metadata().map_err(Self::io(&path))?.len();
                            out.push(ObjectMeta { key, size });
                        }
                    }
                }
            }
            out.sort_by(|a, b| a.key.cmp(&b.key));
            Ok(out)
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let path = self.path(key)?;
        match tokio::fs::remove_file(&path).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::Io { path: path.display().to_string(), source: e }),
        }
    }

    async fn put_multipart(&self, key: &str) -> Result<Box<dyn MultipartUpload>> {
        let path = self.path(key)?;
        let p = path.clone();
        let tmp = blocking(move || Self::temp_in(&p)).await?;
        Ok(Box::new(LocalUpload { key: key.to_string(), path, tmp: Some(tmp), size: 0 }))
    }
}

/// A streaming upload into a temporary file, renamed over the key on completion.
struct LocalUpload {
    key: String,
    path: PathBuf,
    tmp: Option<NamedTempFile>,
    size: u64,
}

#[async_trait]
impl MultipartUpload for LocalUpload {
    async fn write(&mut self, bytes: Bytes) -> Result<()> {
        let tmp = self.tmp.as_mut().ok_or_else(|| StoreError::Backend {
            url: self.path.display().to_string(),
            detail: "upload already completed or aborted".into(),
        })?;
        // Appends to a local file are short; a thread hop per part would cost more.
        tmp.write_all(&bytes).map_err(LocalStore::io(&self.path))?;
        self.size += bytes.len() as u64;
        Ok(())
    }

    async fn complete(&mut self) -> Result<ObjectMeta> {
        let tmp = self.tmp.take().ok_or_else(|| StoreError::Backend {
            url: self.path.display().to_string(),
            detail: "upload already completed or aborted".into(),
        })?;
        let path = self.path.clone();
        blocking(move || {
            tmp.as_file().sync_all().map_err(LocalStore::io(&path))?;
            tmp.persist(&path).map_err(|e| StoreError::Io { path: path.display().to_string(), source: e.error })?;
            sync_parent(&path);
            Ok(())
        })
        .await?;
        Ok(ObjectMeta { key: self.key.clone(), size: self.size })
    }

    async fn abort(&mut self) -> Result<()> {
        // Dropping the temporary file deletes it.
        self.tmp.take();
        Ok(())
    }
}
