//! Files idem writes for an operator: discarded letters and parked events,
//! whose bodies may hold what only the service should read.

use std::path::Path;

/// Opens `path` to append to, creating it readable and writable by its
/// owner alone (mode 0600 on Unix); a file that exists keeps its mode.
pub(crate) fn append_private(path: &Path) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options.create(true).append(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(path)
}

#[cfg(all(test, unix))]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_new_file_is_its_owner_s_alone() -> std::io::Result<()> {
        let path = std::env::temp_dir().join(format!("idem-private-{}.jsonl", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let opened = super::append_private(&path).map(|file| file.metadata());
        let mode = opened
            .and_then(|metadata| metadata)
            .map(|m| m.permissions().mode() & 0o777);
        std::fs::remove_file(&path)?;
        assert_eq!(mode?, 0o600);
        Ok(())
    }
}
