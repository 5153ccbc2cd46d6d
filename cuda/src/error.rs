//! Errors of the CUDA step.

/// What can go wrong loading or running the step.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A CUDA driver call failed.
    #[error("CUDA: {context}: {source}")]
    Driver {
        context: String,
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// This build has no PTX (nvcc was not found when it was compiled).
    #[error("specula-cuda was built without nvcc, so it has no kernels: rebuild with scripts/build-cuda (or SPECULA_NVCC=/path/to/nvcc)")]
    NoPtx,
    /// The model or request is outside what the kernels run.
    #[error("unsupported by the CUDA step: {0}")]
    Unsupported(String),
    /// A bad argument to a step (window size, token id, position).
    #[error("invalid step input: {0}")]
    Invalid(String),
}

/// Result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Adds context to a driver result.
pub(crate) trait Context<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Context<T> for std::result::Result<T, cudarc::driver::DriverError> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Driver {
            context: context(),
            source,
        })
    }
}
