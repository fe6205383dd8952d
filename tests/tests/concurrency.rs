//! The manager shared by 8 threads × 1,000 runs on a hard simulated card: no deadlock, no double onload, no
//! component moved while it runs, and a record whose moves add up to the final placement.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::{
    Action, ComponentError, ComponentsManager, DeviceLedger, DeviceMemory, DeviceName, Direction, Offloadable,
};

/// A component that checks the manager keeps its promises: onload only from the host, offload only from the
/// device, never moved while running.
struct Checked {
    bytes: u64,
    device: DeviceName,
    card: Arc<SimCard>,
    running: Arc<AtomicBool>,
    violations: Arc<AtomicU64>,
    moves: Arc<AtomicU64>,
}

impl Checked {
    fn run(&mut self) -> Result<u64, ComponentError> {
        if self.device.is_cpu() || self.running.swap(true, Ordering::SeqCst) {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
        // An activation: sometimes fails on a crowded card, which the OOM retry must handle.
        let result = self.card.allocate(self.bytes / 4).map(|()| {
            std::thread::yield_now();
            self.card.free(self.bytes / 4);
            self.bytes
        });
        self.running.store(false, Ordering::SeqCst);
        result
    }
}

impl Offloadable for Checked {
    fn bytes(&self) -> u64 {
        self.bytes
    }
    fn device(&self) -> DeviceName {
        self.device.clone()
    }
    fn onload(&mut self, device: &DeviceName) -> Result<(), ComponentError> {
        if !self.device.is_cpu() || self.running.load(Ordering::SeqCst) {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
        self.card.allocate(self.bytes)?;
        self.card.transfer(self.bytes, Direction::HostToDevice)?;
        self.device = device.clone();
        self.moves.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn offload(&mut self) -> Result<(), ComponentError> {
        if self.device.is_cpu() || self.running.load(Ordering::SeqCst) {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
        self.card.free(self.bytes);
        self.device = DeviceName::cpu();
        self.moves.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

#[test]
fn eight_threads_by_a_thousand_runs() {
    const GIB: u64 = 1 << 30;
    let card = SimCard::new(CardSpec::parse("10GiB").unwrap().with_mode(Mode::Hard).with_context_overhead(0));
    let manager = Arc::new(ComponentsManager::new());
    let violations = Arc::new(AtomicU64::new(0));
    let moves = Arc::new(AtomicU64::new(0));
    let sizes = [3 * GIB, 2 * GIB, 2 * GIB, GIB, GIB, GIB / 2];
    let ids: Vec<String> = sizes
        .iter()
        .enumerate()
        .map(|(i, &bytes)| {
            let component = Checked {
                bytes,
                device: DeviceName::cpu(),
                card: card.clone(),
                running: Arc::new(AtomicBool::new(false)),
                violations: violations.clone(),
                moves: moves.clone(),
            };
            manager.add(&format!("c{i}"), component, None).unwrap()
        })
        .collect();
    manager.enable_auto_offload(card.clone(), GIB / 2, true).unwrap();

    let (done, finished) = mpsc::channel();
    for thread in 0..8u64 {
        let (manager, ids, done) = (manager.clone(), ids.clone(), done.clone());
        std::thread::spawn(move || {
            let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ thread;
            let mut failures = 0;
            for _ in 0..1000 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let id = &ids[(seed % ids.len() as u64) as usize];
                // Another thread may hold every other component: then this one cannot make room, which is a
                // typed error, not a hang.
                if manager.run(id, |c: &mut Checked| c.run()).is_err() {
                    failures += 1;
                }
            }
            let _ = done.send(failures);
        });
    }
    drop(done);
    let mut failures = 0;
    for _ in 0..8 {
        failures += finished.recv_timeout(Duration::from_secs(120)).expect("a thread did not finish: deadlock");
    }
    assert_eq!(violations.load(Ordering::SeqCst), 0, "the manager moved a running component or onloaded twice");
    assert!(failures < 8 * 1000 / 2, "{failures} of 8000 runs failed");

    // The record adds up: it holds one event per move the components saw, and, replayed, its moves give the
    // final placement (onloads minus offloads is 1 for a resident component, 0 for one on the host).
    let record = manager.offload_record();
    assert_eq!(record.total_added(), moves.load(Ordering::SeqCst));
    let mut resident_bytes = 0;
    for (id, device) in manager.placement() {
        if !device.is_cpu() {
            resident_bytes += manager.component_info(&id).unwrap().bytes;
        }
    }
    assert_eq!(card.allocated(), resident_bytes, "the card holds exactly the resident weights");
    // The kept window starts mid-run when older events were dropped: replay it from the first event of each
    // component, whose direction tells where that component was before the window.
    let mut balance: HashMap<String, i64> = HashMap::new();
    // Refused rows move nothing: only onloads and offloads add up to the placement.
    for event in record.events().iter().filter(|e| matches!(e.action, Action::Onload | Action::Offload)) {
        let step = if event.action == Action::Onload { 1 } else { -1 };
        let entry = balance.entry(event.id.clone()).or_insert(if step == 1 { 0 } else { 1 });
        *entry += step;
        assert!((0..=1).contains(entry), "{} moved twice the same way", event.id);
    }
    for (id, device) in manager.placement() {
        if let Some(b) = balance.get(&id) {
            assert_eq!(*b, i64::from(!device.is_cpu()), "{id} on {device}");
        }
    }
}
