//! The device layer's edges on the flex CPU backend: a whole onload that panics mid-upload gives its reservation
//! back, the `vulkaninfo` report's parser survives any text, and `vulkaninfo` is run under a deadline.

#![allow(clippy::unwrap_used)] // A test fails loudly at the first unexpected error.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::Device;
use common::{Model, hard_card};
use group_offload::{OffloadDevice, whole::BurnComponent};
use memory_sim::SimCard;
use offload_core::{ComponentError, DeviceLedger, DeviceMemory, DeviceName, Direction, Offloadable};

/// A ledger over the card whose host-to-device transfers panic while `panics` is set: a ledger bug in the middle of
/// an onload, after its reservation was made (not the device's failure, so nothing catches it).
struct PanicsInTransfer {
    card: Arc<SimCard>,
    panics: AtomicBool,
}

impl DeviceLedger for PanicsInTransfer {
    fn allocate(&self, bytes: u64) -> Result<(), ComponentError> {
        self.card.allocate(bytes)
    }

    fn free(&self, bytes: u64) {
        self.card.free(bytes)
    }

    fn allocate_tensors(&self, sizes: &[u64]) -> Result<(), ComponentError> {
        self.card.allocate_tensors(sizes)
    }

    fn free_tensors(&self, sizes: &[u64]) {
        self.card.free_tensors(sizes)
    }

    fn transfer(&self, bytes: u64, direction: Direction) -> Result<(), ComponentError> {
        assert!(!self.panics.load(Ordering::SeqCst), "a ledger bug in the middle of an upload");
        self.card.transfer(bytes, direction)
    }
}

/// A whole onload whose upload panics for a reason other than the device gives back the reservation it made: the
/// account is what it was, so the next refusal is not a false out-of-memory, and the next onload fits.
#[test]
fn a_whole_onload_that_panics_mid_upload_gives_its_reservation_back() {
    let card = hard_card(1 << 20);
    let ledger = Arc::new(PanicsInTransfer { card: card.clone(), panics: AtomicBool::new(true) });
    let name = DeviceName::parse("cuda").unwrap();
    let placement = OffloadDevice::on_device(Device::flex(), name.clone(), ledger.clone(), Some(card.clone()));
    let mut component = BurnComponent::new(Model::new(&Device::flex()), "model", placement);
    let before = card.allocated();
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| component.onload(&name)));
    assert!(unwound.is_err(), "the ledger's panic reached the caller");
    assert_eq!(card.allocated(), before, "the onload's reservation was given back");
    assert!(component.device().is_cpu(), "the component stayed on the host");
    // The account is whole: an onload that fits is granted, and its offload leaves the card as it was.
    ledger.panics.store(false, Ordering::SeqCst);
    component.onload(&name).unwrap();
    assert_eq!(card.allocated(), before + component.bytes());
    component.offload().unwrap();
    assert_eq!(card.allocated(), before);
}

/// A stand-in `vulkaninfo`: an executable shell script with `body`, in a directory of its own.
fn stand_in(test: &str, body: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("device-edges-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("vulkaninfo");
    std::fs::write(&script, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    (dir, script)
}

/// A `vulkaninfo` that hangs (a wedged driver) is stopped at the deadline, and the reason says so; the caller waits
/// the deadline, not the hang.
#[test]
fn a_hung_vulkaninfo_is_stopped_at_its_deadline_and_says_so() {
    use group_offload::vulkaninfo;
    let (dir, script) = stand_in("hung", "sleep 30");
    let deadline = std::time::Duration::from_millis(300);
    let started = std::time::Instant::now();
    let why = vulkaninfo::run(script.as_os_str(), deadline).unwrap_err();
    let waited = started.elapsed();
    assert_eq!(
        why,
        "vulkaninfo did not answer within 0.3 s and was stopped (a hung Vulkan driver? `vulkaninfo --summary` shows \
         whether it answers)"
    );
    assert!(waited >= deadline && waited < std::time::Duration::from_secs(5), "waited {waited:?}");
    assert_eq!(vulkaninfo::TIMEOUT, std::time::Duration::from_secs(5));
    std::fs::remove_dir_all(&dir).ok();
}

/// A `vulkaninfo` that answers gives its report whole (larger than a pipe's buffer, so it is read while the process
/// runs), and one that fails or cannot start says which.
#[test]
fn vulkaninfos_report_is_read_whole_and_its_failures_are_named() {
    use group_offload::vulkaninfo;
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/vulkaninfo-lavapipe.txt");
    // Twice the fixture: 100 KB and more, above the pipe's 64 KB.
    let (dir, script) = stand_in("answers", &format!("cat '{fixture}' '{fixture}'"));
    let report = vulkaninfo::run(script.as_os_str(), vulkaninfo::TIMEOUT).unwrap();
    let expected = std::fs::read_to_string(fixture).unwrap();
    assert_eq!(report, format!("{expected}{expected}"));
    assert_eq!(vulkaninfo::parse(&report).len(), 2);
    std::fs::remove_dir_all(&dir).ok();

    let (dir, script) = stand_in("fails", "exit 3");
    assert_eq!(
        vulkaninfo::run(script.as_os_str(), vulkaninfo::TIMEOUT).unwrap_err(),
        "vulkaninfo failed (exit status: 3)"
    );
    let missing = dir.join("missing");
    let why = vulkaninfo::run(missing.as_os_str(), vulkaninfo::TIMEOUT).unwrap_err();
    assert!(why.starts_with("vulkaninfo could not run (No such file or directory"), "{why}");
    assert!(why.ends_with("Debian: `apt-get install vulkan-tools`)"), "{why}");
    std::fs::remove_dir_all(&dir).ok();
}
