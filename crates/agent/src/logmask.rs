//! One job's masker: the values of its secrets, and the values the job registers while it
//! runs (`::add-mask::VALUE` on its standard output; the rules, limits and what counts as a
//! derived form are `gpuci_core::mask`'s).
//!
//! Both output streams and gpuci's own lines about the job read the same masker, so a value
//! registered on standard output is masked on standard error too, from the moment the
//! command line is read. What was already forwarded cannot be taken back: a job registers a
//! value before it prints it. A line being held back at a cut (`Masker::cut`) is masked again
//! with the next piece, by the masker of that moment, so a value registered meanwhile is
//! still caught there.
//!
//! A registration only ever adds to what is masked (the core masks the union of every
//! match), and is bounded per job in number and length, so a job can neither uncover a secret
//! nor grow the agent's memory through it.

use gpuci_core::mask::{Masker, RegisterError};
use std::sync::{Arc, RwLock};

pub(crate) struct JobMask {
    current: RwLock<Arc<Masker>>,
}

impl JobMask {
    pub(crate) fn new(masker: Masker) -> JobMask {
        JobMask { current: RwLock::new(Arc::new(masker)) }
    }

    /// The masker as of now (cheap: the lines being masked keep their copy while a
    /// registration builds the next one).
    pub(crate) fn get(&self) -> Arc<Masker> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// `line` (of the job's standard output, newline removed) as an `::add-mask::` command:
    /// `None` when it is none, else whether its value is now masked.
    pub(crate) fn command(&self, line: &str) -> Option<Result<(), RegisterError>> {
        let value = gpuci_core::mask::add_mask_command(line)?;
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        // Checked before the copy: a job repeating a refused command costs no rebuild.
        if let Err(refused) = current.admits(&value) {
            return Some(Err(refused));
        }
        let mut next = Masker::clone(&current);
        Some(next.register(&value).map(|()| *current = Arc::new(next)))
    }
}
