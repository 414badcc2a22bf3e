//! Ctrl-C and result files: a long command (`exec run`, `exec stress`, `profile measure`) stops cleanly at its
//! next check point instead of dying mid-write, and its result files appear whole or not at all.
//!
//! [`install`] replaces the default SIGINT action (kill the process) with setting [`FLAG`]; the executor checks
//! it before every forward pass (`RunOptions::interrupt`), the profiler at every measurement step, the CLI's
//! loops between cells. The run then unwinds normally, so device memory and page-locked host memory are
//! released by their owners' `Drop`. A second Ctrl-C exits at once (status 130) for a run that does not reach
//! a check point. [`write_atomic`] writes a result to a temporary file beside its destination and renames it at
//! the end, so an interrupted or failed command never leaves a half-written result.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;

/// Raised by the first Ctrl-C after [`install`].
pub static FLAG: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_signal: libc::c_int) {
    if FLAG.swap(true, Ordering::SeqCst) {
        // SAFETY: `_exit` is async-signal-safe; a second Ctrl-C means "now".
        unsafe { libc::_exit(130) };
    }
}

/// Routes Ctrl-C (SIGINT) to [`FLAG`]; idempotent.
pub fn install() {
    // SAFETY: the handler only touches an atomic and calls `_exit`, both async-signal-safe.
    unsafe { libc::signal(libc::SIGINT, on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t) };
}

/// Whether Ctrl-C was pressed.
pub fn raised() -> bool {
    FLAG.load(Ordering::Relaxed)
}

/// The error a command returns when it stopped on Ctrl-C: `what` says which files were left untouched.
pub fn stopped(what: &str) -> anyhow::Error {
    anyhow::anyhow!("interrupted (Ctrl-C); {what}")
}

/// The temporary file [`write_atomic`] writes before renaming: hidden, beside `path`, named by process id.
fn temp_path(path: &Path) -> PathBuf {
    let name = path.file_name().map_or_else(|| "out".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.partial-{}", std::process::id()))
}

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename, so `path` holds either
/// its old content or all of the new one. Missing parent folders are created.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating the folder {}", dir.display()))?;
    }
    let tmp = temp_path(path);
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| {
        let _ = std::fs::remove_file(&tmp);
        format!("renaming {} to {}", tmp.display(), path.display())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write that fails part-way (here: the rename onto a folder) leaves neither the destination changed nor
    /// the temporary file behind; a write that succeeds replaces the content whole.
    #[test]
    fn atomic_writes_leave_no_partial_files() {
        let dir = crate::testfiles::temp_dir("atomic-write");
        let file = dir.join("cells.csv");
        std::fs::write(&file, "old\n").unwrap();
        write_atomic(&file, b"new,rows\n1,2\n").unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "new,rows\n1,2\n");
        let nested = dir.join("traces/run1/trace.json");
        write_atomic(&nested, b"{}").unwrap();
        assert_eq!(std::fs::read_to_string(&nested).unwrap(), "{}");
        std::fs::remove_dir_all(dir.join("traces")).unwrap();
        let blocked = dir.join("a-folder");
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("inside"), "x").unwrap();
        assert!(write_atomic(&blocked, b"data").is_err());
        assert!(blocked.is_dir());
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into())
            .collect();
        names.sort();
        assert_eq!(names, ["a-folder", "cells.csv"], "no temporary file is left");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
