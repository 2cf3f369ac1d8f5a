//! Placeholder; see below.
