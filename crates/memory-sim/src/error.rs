//! The crate's error type.

use offload_core::SizeError;

/// Everything `memory-sim` can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// A card label that is neither a size nor a catalogue name.
    #[error("unknown card {name:?}: give a size such as \"16GB\" or \"13.5GiB\", or one of: {known}")]
    UnknownCard {
        /// The label as given.
        name: String,
        /// The catalogue's names, comma-separated.
        known: String,
    },

    /// A size that could not be read.
    #[error(transparent)]
    Size(#[from] SizeError),

    /// A card or configuration that cannot work.
    #[error("impossible configuration for card {label}: {problem}; choose a larger card or a smaller reserve")]
    ImpossibleCard {
        /// The card.
        label: String,
        /// What is wrong.
        problem: String,
    },

    /// A link name that is not one of [`crate::donors::LINKS`].
    #[error("unknown link {name:?}: give a peer card as CARD@LINK with LINK one of: {accepted}")]
    UnknownLink {
        /// The link as given.
        name: String,
        /// The accepted names, comma-separated.
        accepted: String,
    },

    /// A donor placement that the simulated hardware cannot run: a group on a peer card that cannot hold it, a
    /// donor that does not exist.
    #[error("cannot run the donor placement: {problem}; place with DonorMachine::problem's donors and budgets")]
    Placement {
        /// What failed.
        problem: String,
    },

    /// A card expectation file that could not be read.
    #[error("cannot read the card expectations: {0}; fix the TOML (see docs/offload-record.md for the format)")]
    Expectations(String),

    /// The manager failed during a simulated run.
    #[error(transparent)]
    Manager(#[from] offload_core::Error),
}
