//! The device object: one [`OffloadDevice`] per execution device, created once and handed over once. It owns what
//! runs on the device: its account (the ledger every move is charged to and the readings of its memory), its upload
//! thread, the clock on its link, and a manager its models are registered in, whose record and timeline every move
//! onto the device is written to.

use std::any::Any;
use std::sync::Arc;

use burn::tensor::{Device, Tensor};
use offload_core::link::{LinkMeter, LinkRate, LinkSample};
use offload_core::{ComponentsManager, DeviceLedger, DeviceMemory, DeviceName, NoLedger};

use crate::device::cap::CappedDevice;
use crate::device::pool::PoolReadings;
use crate::device::{DevicePanic, catch_device_panic, check_device, check_outputs};
use crate::error::Result;
use crate::uploads::{Task, UploadThread};

/// One execution device and everything that runs on it: the burn device that computes, the host device offloaded
/// weights live on, the device's name, its account (ledger and readings), its upload thread, its link's clock and
/// its manager. Cloning it clones a handle to the same device (one account, one thread, one meter).
///
/// The run side of a model crate is this type and [`ModelHandle`]:
///
/// ```
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Device, Tensor};
/// use group_offload::prelude::*;
///
/// #[derive(Module, Debug)]
/// struct Block { fc: Linear }
///
/// #[derive(Module, Debug, OffloadModel)]
/// struct Net { #[offload(blocks)] blocks: Vec<Block> }
///
/// let net = Net { blocks: (0..3).map(|_| Block { fc: LinearConfig::new(4, 4).init(&Device::flex()) }).collect() };
/// // The card is handed over once: the device owns its account, its upload thread and its manager.
/// let device = OffloadDevice::simulated(memory_sim::SimCard::new(memory_sim::CardSpec::parse("1MB")?));
/// let mut net = device.register("net", net)?;
/// net.enable_group_offload(&GroupOptions::default())?;
/// device.enable_auto_offload(0)?;
/// let y = net.run(0, |weights, exec| {
///     let x = Tensor::<2>::ones([1, 4], exec);
///     weights.blocks.fold(x, |block, x| Ok(leaf!(block, fc).forward(x)))
/// })?;
/// assert_eq!(y.dims(), [1, 4]);
/// assert!(!device.manager().offload_record().is_empty(), "every move is in the device's record");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct OffloadDevice(Arc<Shared>);

/// What one device owns, behind every handle to it.
struct Shared {
    exec: Device,
    host: Device,
    name: DeviceName,
    ledger: Arc<dyn DeviceLedger>,
    memory: Option<Arc<dyn DeviceMemory>>,
    link: Arc<LinkMeter>,
    /// One clock per peer whose memory groups are copied from onto this device (a donor card's), by its name.
    peer_links: Arc<PeerLinks>,
    uploads: Arc<UploadThread>,
    manager: Arc<ComponentsManager>,
    /// The object behind the account, where a constructor was given one (a simulated card, a real device's pool
    /// readings, a cap over them): what a program's reports ask about ([`OffloadDevice::account`]).
    account: Option<Arc<dyn Any + Send + Sync>>,
}

/// The clocks on the copies from other devices' memory onto one device, one per peer.
#[derive(Default)]
struct PeerLinks(parking_lot::Mutex<Vec<(DeviceName, Arc<LinkMeter>)>>);

impl OffloadDevice {
    /// `exec` computes (a real device, or the CPU under a card of the caller's), offloaded weights live on the CPU
    /// backend, the device is known as `name`, and `ledger` and `memory` are its one account (`NoLedger` and
    /// `PoolReadings` on an uncapped device, a `CappedDevice` for both under a cap, a `SimCard` on the CPU).
    pub fn on_device(
        exec: Device,
        name: DeviceName,
        ledger: Arc<dyn DeviceLedger>,
        memory: Option<Arc<dyn DeviceMemory>>,
    ) -> Self {
        Self::built_on(exec, name, ledger, memory, None)
    }

    /// [`on_device`](Self::on_device), keeping `account` as the object behind the account.
    fn built_on(
        exec: Device,
        name: DeviceName,
        ledger: Arc<dyn DeviceLedger>,
        memory: Option<Arc<dyn DeviceMemory>>,
        account: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Self {
        Self(Arc::new(Shared {
            exec,
            host: Device::flex(),
            uploads: Arc::new(UploadThread::new(name.clone())),
            name,
            ledger,
            memory,
            link: Arc::default(),
            peer_links: Arc::default(),
            manager: Arc::new(ComponentsManager::new()),
            account,
        }))
    }

    /// The same device under another account: the same burn device, name, upload thread and link meter, with
    /// `ledger` and `memory` as its account and a manager of its own. How a cap over a real device is laid over it
    /// (`device.with_account(cap.clone(), Some(cap))`, a `CappedDevice`) without a second upload thread: a new
    /// thread is a new cubecl stream, whose pools size their first pages far above small tensors.
    pub fn with_account(&self, ledger: Arc<dyn DeviceLedger>, memory: Option<Arc<dyn DeviceMemory>>) -> Self {
        Self(Arc::new(Shared {
            exec: self.0.exec.clone(),
            host: self.0.host.clone(),
            name: self.0.name.clone(),
            ledger,
            memory,
            link: self.0.link.clone(),
            peer_links: self.0.peer_links.clone(),
            uploads: self.0.uploads.clone(),
            manager: Arc::new(ComponentsManager::new()),
            account: None,
        }))
    }

    /// Everything on the host's CPU backend: nothing moves, nothing is accounted.
    pub fn host_only() -> Self {
        Self::on_device(Device::flex(), DeviceName::cpu(), Arc::new(NoLedger), None)
    }

    /// A simulated card on the CPU: the weights stay in host memory (burn's `flex` backend), the card (anything
    /// that is both the ledger and the readings: `memory_sim::SimCard`) accounts for them, and the components
    /// are known by the card's device name.
    pub fn simulated<C: DeviceLedger + DeviceMemory + Send + Sync + 'static>(card: Arc<C>) -> Self {
        let name = DeviceMemory::device(&*card);
        Self::built_on(Device::flex(), name, card.clone(), Some(card.clone()), Some(card))
    }

    /// A real device read through its pool: nothing is charged ([`NoLedger`]: the runtime allocates for itself),
    /// and `readings` are what auto offload, the reports and the timeline read.
    pub fn pooled(exec: Device, name: DeviceName, readings: Arc<PoolReadings>) -> Self {
        Self::built_on(exec, name, Arc::new(NoLedger), Some(readings.clone()), Some(readings))
    }

    /// A real device under a cap ([`CappedDevice`]): the cap is the ledger every move is charged to and the
    /// readings everything decides by.
    pub fn capped(exec: Device, name: DeviceName, cap: Arc<CappedDevice>) -> Self {
        Self::built_on(exec, name, cap.clone(), Some(cap.clone()), Some(cap))
    }

    /// The object behind the device's account, when it is a `T`: the simulated card of
    /// [`simulated`](Self::simulated) (`device.account::<memory_sim::SimCard>()`), the [`PoolReadings`] of
    /// [`pooled`](Self::pooled), the [`CappedDevice`] of [`capped`](Self::capped); `None` otherwise (a device built
    /// from a ledger and readings with [`on_device`](Self::on_device) or [`with_account`](Self::with_account)).
    /// What a program's reports read: the card's label and statistics, the pool's high-water, the cap.
    pub fn account<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        self.0.account.clone()?.downcast::<T>().ok()
    }

    /// The real device's pool readings, also under a cap ([`CappedDevice::readings`]); `None` on a simulated card
    /// or a device nothing reads.
    pub fn pool_readings(&self) -> Option<Arc<PoolReadings>> {
        self.account::<PoolReadings>().or_else(|| self.account::<CappedDevice>().map(|cap| cap.readings().clone()))
    }

    /// The burn device that computes (`Device::cuda(0)`, or `Device::flex()` under a simulated card).
    pub fn exec(&self) -> &Device {
        &self.0.exec
    }

    /// The burn device offloaded weights live on.
    pub fn host(&self) -> &Device {
        &self.0.host
    }

    /// The device's name in managers, records and errors (`cuda:0`).
    pub fn name(&self) -> &DeviceName {
        &self.0.name
    }

    /// The account every allocation, transfer and free on the device is charged to.
    pub fn ledger(&self) -> &Arc<dyn DeviceLedger> {
        &self.0.ledger
    }

    /// Readings of the device's memory (a real device's pool, a cap over it, a simulated card), for the available
    /// bytes an out-of-memory reports and the samples of the timeline; `None` where nothing reads it.
    pub fn memory(&self) -> &Option<Arc<dyn DeviceMemory>> {
        &self.0.memory
    }

    /// The readings auto offload decides by: the device's own, or, on a device nothing reads, readings of a device
    /// large enough for everything (every component onloaded at its first run and never evicted, each move still
    /// going through the manager and its record).
    pub fn readings(&self) -> Arc<dyn DeviceMemory> {
        match &self.0.memory {
            Some(memory) => memory.clone(),
            None => Arc::new(Unbounded { device: self.0.name.clone() }),
        }
    }

    /// The clock on the link to the device: every whole onload and every group upload onto it notes its bytes and
    /// wall time here.
    pub fn link(&self) -> &Arc<LinkMeter> {
        &self.0.link
    }

    /// The link rate the moves onto this device reached, measured by the clock; `None` before the first. Under a
    /// simulated card this is a host copy's rate, not the card's simulated link.
    pub fn link_rate(&self) -> Option<LinkRate> {
        self.0.link.rate()
    }

    /// The clock on the copies from `peer`'s memory onto this device: every group upload that comes from a donor
    /// card (`GroupOptions::donor`) notes its bytes and wall time, from the start of the copy to the synced
    /// read-back that publishes the group, on its donor's meter. A plan prices that peer's bytes at the rate it
    /// measured once a run has stored it (`PeerRun::from_rate`, `ProfileStore::record_peer`,
    /// `PeerDevice::with_measured`). Under a simulated card the copy is a host copy, not the card's simulated link.
    pub fn peer_link(&self, peer: &DeviceName) -> Arc<LinkMeter> {
        let mut meters = self.0.peer_links.0.lock();
        match meters.iter().find(|(name, _)| name == peer) {
            Some((_, meter)) => meter.clone(),
            None => {
                let meter = Arc::new(LinkMeter::default());
                meters.push((peer.clone(), meter.clone()));
                meter
            }
        }
    }

    /// The rate each peer's copies onto this device reached, measured by the clock, for the peers that made a
    /// copy, in the order they first did.
    pub fn peer_rates(&self) -> Vec<(DeviceName, LinkRate)> {
        let meters = self.0.peer_links.0.lock();
        meters.iter().filter_map(|(name, meter)| Some((name.clone(), meter.rate()?))).collect()
    }

    /// Times `copies` copies of `bytes` from `peer`'s memory onto this device, each from the start of the copy to
    /// a synced read-back of one value, as the uploads of the groups a donor holds are timed. What a plan prices a
    /// peer at before a run has measured its copies (`PeerDevice::new(.., rate.median, ..)`); the copies are not
    /// noted on [`peer_link`](Self::peer_link), which keeps the run's own. The probe is built on `peer` and dropped
    /// with its copies: nothing of it stays on either device.
    ///
    /// Refused ([`Error::PeerCopy`](crate::Error::PeerCopy)) where both compute on the same burn device (two
    /// simulated cards share the host's CPU backend: a copy between them crosses no link, so declare their
    /// link's rate), and where the probe's allocation, a copy or a read-back fails.
    pub fn time_copies_from(&self, peer: &OffloadDevice, bytes: u64, copies: usize) -> Result<LinkRate> {
        let refused = |problem: String| crate::Error::PeerCopy {
            peer: peer.name().to_string(),
            device: self.name().to_string(),
            problem,
        };
        if self.exec() == peer.exec() {
            return Err(refused(format!("both compute on {:?}, so a copy between them crosses no link", self.exec())));
        }
        let failed = |error: offload_core::ComponentError| refused(error.to_string());
        let on = |device: &OffloadDevice, panic: DevicePanic| {
            failed(panic.with_device(device.name(), "copy probe", device.memory().as_deref()))
        };
        let floats = usize::try_from(bytes / 4).unwrap_or(usize::MAX).max(1);
        let probe = catch_device_panic(|| Tensor::<1>::ones([floats], peer.exec())).map_err(|p| on(peer, p))?;
        check_device(peer.exec(), peer.name(), "copy probe", peer.memory().as_deref()).map_err(failed)?;
        let mut samples = Vec::with_capacity(copies.max(1));
        for _ in 0..copies.max(1) {
            let started = std::time::Instant::now();
            let copy = catch_device_panic(|| probe.clone().to_device(self.exec())).map_err(|p| on(self, p))?;
            check_device(self.exec(), self.name(), "copy probe", self.memory().as_deref()).map_err(failed)?;
            check_outputs(&copy, self.exec(), self.name(), "copy probe", self.memory().as_deref()).map_err(failed)?;
            let seconds = started.elapsed().as_secs_f64();
            samples.push(LinkSample { bytes: floats as u64 * 4, seconds, page_locked: false });
        }
        LinkRate::of(&samples).ok_or_else(|| refused("no copy was timed".into()))
    }

    /// The device's manager: the models registered on the device ([`OffloadDevice::register`], in `handle`), its auto offload, OOM retry
    /// and record ([`ComponentsManager::offload_record`]).
    pub fn manager(&self) -> &Arc<ComponentsManager> {
        &self.0.manager
    }

    /// Enables auto offload and the OOM retry in the device's manager, deciding by the device's own
    /// [`readings`](Self::readings) with `reserve` bytes kept free.
    pub fn enable_auto_offload(&self, reserve: u64) -> Result<()> {
        Ok(self.0.manager.enable_auto_offload(self.readings(), reserve, true)?)
    }

    /// Gives back to the device the pages its pools keep and nothing uses, on both streams this device object
    /// allocates on: the calling thread's and its upload thread's. cubecl keeps pools per stream, and burn's
    /// `Device::memory_cleanup` cleans the calling thread's only, so the pages of the groups and whole onloads the
    /// upload thread made stayed in its pool after they were released: counted against a cap, and out of reach of
    /// the calls on the computing thread. The upload thread is asked only where it has started (it finishes the
    /// uploads queued before); nothing happens on the CPU backend. A failure of the upload thread is left to its
    /// next upload, which reports it typed.
    pub fn memory_cleanup(&self) {
        if !crate::device::defers_failures(&self.0.exec) {
            return;
        }
        self.0.exec.memory_cleanup();
        if self.0.uploads.is_started() {
            let exec = self.0.exec.clone();
            let _ = self.0.uploads.run(move || exec.memory_cleanup());
        }
    }

    /// Whether `other` is a handle to this same device object (not merely a device of the same name).
    pub fn is(&self, other: &OffloadDevice) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The device's upload thread's queue, started at its first use.
    pub(crate) fn upload_queue(&self) -> std::io::Result<std::sync::mpsc::Sender<Task>> {
        self.0.uploads.sender()
    }

    /// Runs `f` on the device's upload thread and waits for it ([`UploadThread::run`]).
    pub(crate) fn on_upload_thread<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> Result<R> {
        self.0.uploads.run(f)
    }
}

impl From<Device> for OffloadDevice {
    /// A device with nothing accounted and nothing read: `cpu` for a CPU backend, `cuda:0` otherwise (name another
    /// device with [`OffloadDevice::on_device`]).
    fn from(exec: Device) -> Self {
        let debug = format!("{exec:?}").to_ascii_lowercase();
        let name = if debug.contains("cuda") { DeviceName::parse("cuda") } else { Ok(DeviceName::cpu()) }
            .unwrap_or_else(|_| DeviceName::cpu());
        Self::on_device(exec, name, Arc::new(NoLedger), None)
    }
}

impl std::fmt::Debug for OffloadDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadDevice")
            .field("exec", &self.0.exec)
            .field("name", &self.0.name)
            .field("memory", &self.0.memory.is_some())
            .finish()
    }
}

/// Readings of a device treated as large enough for everything ([`OffloadDevice::readings`] of a device nothing
/// reads).
#[derive(Debug, Clone)]
struct Unbounded {
    device: DeviceName,
}

impl DeviceMemory for Unbounded {
    fn device(&self) -> DeviceName {
        self.device.clone()
    }

    fn total(&self) -> u64 {
        u64::MAX / 2
    }

    fn available(&self) -> u64 {
        u64::MAX / 2
    }

    fn allocated(&self) -> u64 {
        0
    }

    fn peak(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device owns its upload thread: two device objects over the same burn device have a thread each, a clone
    /// shares its device's, and the thread ends when the device's last handle is dropped (no process-wide registry
    /// keeps it).
    #[test]
    fn each_device_object_owns_its_upload_thread_and_ends_it() {
        let name = DeviceName::parse("cuda:3").expect("a device name");
        let first = OffloadDevice::on_device(Device::flex(), name.clone(), Arc::new(NoLedger), None);
        let second = OffloadDevice::on_device(Device::flex(), name, Arc::new(NoLedger), None);
        let thread = || std::thread::current().id();
        let a = first.on_upload_thread(thread).expect("runs");
        let b = second.on_upload_thread(thread).expect("runs");
        let a_again = first.clone().on_upload_thread(thread).expect("runs");
        assert_ne!(a, b, "two device objects, two threads");
        assert_eq!(a, a_again, "a clone is the same device");
        assert!(first.is(&first.clone()) && !first.is(&second));
        // Another account over the same device keeps its upload thread.
        let capped = first.with_account(Arc::new(NoLedger), None);
        assert_eq!(capped.on_upload_thread(thread).expect("runs"), a, "the same device, the same thread");
        assert!(!capped.is(&first) && !Arc::ptr_eq(capped.manager(), first.manager()));
        drop(capped);
        // The thread ends once the device's last handle and every queue taken from it are gone: a value it holds
        // in a thread local is dropped at its exit and says so.
        struct SaysWhenDropped(std::sync::mpsc::Sender<()>);
        impl Drop for SaysWhenDropped {
            fn drop(&mut self) {
                let _ = self.0.send(());
            }
        }
        thread_local!(static MARK: std::cell::RefCell<Option<SaysWhenDropped>> = const { std::cell::RefCell::new(None) });
        let (ended, thread_ended) = std::sync::mpsc::channel();
        first
            .on_upload_thread(move || MARK.with(|mark| *mark.borrow_mut() = Some(SaysWhenDropped(ended))))
            .expect("runs");
        drop(first);
        thread_ended.recv_timeout(std::time::Duration::from_secs(10)).expect("the thread ended with its device");
    }

    /// A device nothing reads decides by unbounded readings named after it; a simulated card by the card.
    #[test]
    fn readings_are_the_devices_own_or_unbounded() {
        let host = OffloadDevice::host_only();
        assert_eq!(host.readings().device(), DeviceName::cpu());
        assert!(host.readings().available() > 1 << 60);
    }

    /// The object behind the account is what the constructor was given, asked for by its type: the reports of a
    /// program read the card from the device object, not from a second copy of what backs it.
    #[test]
    fn the_account_is_the_object_the_device_was_built_on() {
        let card = memory_sim::SimCard::new(memory_sim::CardSpec::parse("1MB").expect("a size"));
        let device = OffloadDevice::simulated(card.clone());
        let found = device.account::<memory_sim::SimCard>().expect("the card");
        assert!(Arc::ptr_eq(&found, &card));
        assert_eq!(device.readings().total(), card.total());
        assert!(device.account::<PoolReadings>().is_none() && device.pool_readings().is_none());
        assert!(device.clone().account::<memory_sim::SimCard>().is_some(), "a handle to the same device");
        // Another account over the same device is not the card's.
        assert!(device.with_account(Arc::new(NoLedger), None).account::<memory_sim::SimCard>().is_none());
        assert!(OffloadDevice::host_only().account::<memory_sim::SimCard>().is_none());
    }
}
