//! The error of idem's operator commands as library calls (a dead-letter
//! pass, `status`, `prune`, `reconcile`): what was being done and why, as a
//! chain of causes.

use std::fmt;

/// Why an operator command could not be done. Its text is the outermost
/// context (`cannot open discards.jsonl to discard into`); `{:#}` adds
/// every cause on one line, and [`source`](std::error::Error::source)
/// walks them.
pub struct CommandError(anyhow::Error);

impl CommandError {
    /// The first cause of type `T` in the chain, the outermost included:
    /// a [`ReadyError`](crate::store::ReadyError) when the database did not
    /// answer, say.
    pub fn find<T: std::error::Error + 'static>(&self) -> Option<&T> {
        self.0.chain().find_map(|cause| cause.downcast_ref::<T>())
    }
}

impl CommandError {
    /// Every cause, the outermost first, each as its own type.
    #[cfg(feature = "cli")]
    pub(crate) fn chain(&self) -> anyhow::Chain<'_> {
        self.0.chain()
    }
}

impl From<anyhow::Error> for CommandError {
    fn from(error: anyhow::Error) -> Self {
        Self(error)
    }
}

impl fmt::Display for CommandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if f.alternate() {
            write!(f, "{:#}", self.0)
        } else {
            write!(f, "{}", self.0)
        }
    }
}

impl fmt::Debug for CommandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl std::error::Error for CommandError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// A command's result.
pub type CommandResult<T> = Result<T, CommandError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_reads_as_the_chain_it_wraps() {
        let inner = anyhow::Error::new(std::io::Error::other("disk full")).context("writing x");
        let error = CommandError::from(inner);
        assert_eq!(error.to_string(), "writing x");
        assert_eq!(format!("{error:#}"), "writing x: disk full");
        assert!(error.find::<std::io::Error>().is_some());
        let wrapped = anyhow::Error::new(error);
        assert_eq!(format!("{wrapped:#}"), "writing x: disk full");
    }
}
