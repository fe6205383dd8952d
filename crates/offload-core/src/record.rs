//! The offload record: every move the manager and the group offloaders made, and every move they were refused,
//! with the reading each was made on.
//!
//! The record is a bounded list of [`OffloadEvent`]s of two kinds. The manager's decisions move whole components
//! (an onload, the offloads that made room for it, an `oom_retry`, `offloading_disabled`); the group offloaders'
//! moves stream the groups of a model under group offload (`group_onload`, `prefetch`, `group_offload`, and a
//! prefetch the device refused, `prefetch_refused` or `prefetch_failed`), their ids `model/group`. Its
//! [`Display`](fmt::Display) prints both, one row per event or decision; on a record of the manager's decisions
//! alone it is byte-identical to the anchor's `OffloadRecord.__repr__` (diffusers PR #14304): one row per
//! decision, the offloads that made room for an onload folded into its row. [`OffloadRecord::decisions`] and
//! [`OffloadRecord::group_moves`] print each kind apart (a streamed model makes thousands of group moves an image,
//! the manager a handful of decisions), and [`OffloadRecord::refusals_since`] sums the refusals of a stretch of a
//! run in the one line a program prints after each image. Programs walk the same rows as data with
//! [`OffloadRecord::rows`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::size::format_size;

/// The most events a record keeps; the oldest are dropped past this.
pub const MAX_EVENTS: usize = 10_000;

/// Which way a component (or a group of one) moved, or that a move was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Moved from the host onto the execution device.
    Onload,
    /// Moved from the execution device to the host.
    Offload,
    /// A move onto the device that was asked for and did not happen (a prefetch the device refused or that
    /// failed): nothing moved, and the group stayed on the host to be loaded when its forward takes it. Never
    /// counted as a move; its reason says why ([`Reason::PrefetchRefused`], [`Reason::PrefetchFailed`]).
    Refused,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Onload => "onload",
            Action::Offload => "offload",
            Action::Refused => "refused",
        })
    }
}

/// Why a move happened. Its `Display` is the anchor's reason string.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Offloaded by the strategy to make room for the named component (`release_memory_for:<id>`).
    ReleaseMemoryFor(String),
    /// Offloaded after the named component ran out of memory (`oom_retry:<id>`).
    OomRetry(String),
    /// Offloaded because auto offload was disabled (`offloading_disabled`).
    OffloadingDisabled,
    /// A group uploaded when the model took it: the capture pass, or a miss (`group_onload`).
    GroupOnload,
    /// A group uploaded ahead of its use by the prefetch worker (`prefetch`).
    Prefetch,
    /// A group released from the device after its use (`group_offload`).
    GroupOffload,
    /// A prefetch the device refused for lack of memory (`prefetch_refused`, an [`Action::Refused`] event with the
    /// group, its bytes and the reading the refusal was made on): the group was loaded when taken instead.
    PrefetchRefused,
    /// A prefetch that failed for another reason than memory (`prefetch_failed`, an [`Action::Refused`] event:
    /// a transfer that failed, an upload that panicked); the group was loaded when taken instead, and the error
    /// was logged.
    PrefetchFailed,
    /// A move made by a mechanism outside the workspace, printed as given.
    Other(String),
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::ReleaseMemoryFor(id) => write!(f, "release_memory_for:{id}"),
            Reason::OomRetry(id) => write!(f, "oom_retry:{id}"),
            Reason::OffloadingDisabled => f.write_str("offloading_disabled"),
            Reason::GroupOnload => f.write_str("group_onload"),
            Reason::Prefetch => f.write_str("prefetch"),
            Reason::GroupOffload => f.write_str("group_offload"),
            Reason::PrefetchRefused => f.write_str("prefetch_refused"),
            Reason::PrefetchFailed => f.write_str("prefetch_failed"),
            Reason::Other(text) => f.write_str(text),
        }
    }
}

/// One move (or one refused move), with the device reading taken just before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadEvent {
    /// Onload, offload, or a refused onload.
    pub action: Action,
    /// The component (or `component/group`) that moved.
    pub id: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Why; `None` on an onload the incoming component asked for.
    pub reason: Option<Reason>,
    /// Bytes available on the device just before the move.
    pub available: Option<u64>,
    /// The device's peak allocation just before the move.
    pub peak: Option<u64>,
    /// The read of the host copy from a file that the move made (a group read from its checkpoint file, the
    /// file tier, or from the disk store); `None` for a host copy in memory and for the manager's moves.
    pub read: Option<FileRead>,
    /// The device an upload copied the group from, where it was not the host: a donor holding it between its
    /// uploads (`cuda:1`). The record's table shows it after the reason (`prefetch, from cuda:1`).
    pub from_peer: Option<String>,
}

/// A move's read of its host copy from a file: its bytes and wall time, as the disk meter noted it
/// ([`crate::link::DiskMeter`]). The record's table shows it after the reason (`prefetch, from file: 4.00 MB in
/// 1.2 ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileRead {
    /// Bytes read.
    pub bytes: u64,
    /// Wall time of the read, nanoseconds.
    pub nanos: u64,
}

impl fmt::Display for FileRead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "from file: {} in {:.1} ms", format_size(self.bytes), self.nanos as f64 / 1e6)
    }
}

impl OffloadEvent {
    /// Whether the event is a group offloader's (its id is `model/group`; a component's id never holds a `/`),
    /// not a manager's decision.
    pub fn is_group_move(&self) -> bool {
        self.id.contains('/')
    }

    /// Whether the event is a move that was refused ([`Action::Refused`]).
    pub fn is_refusal(&self) -> bool {
        self.action == Action::Refused
    }
}

/// One row of the record's table: one decision, or one group move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordRow {
    /// The component onloaded by this decision, with its size; `None` for a row that only offloads.
    pub onload: Option<(String, u64)>,
    /// The group whose prefetch was refused, with its size ([`Action::Refused`]); printed in the Onload column,
    /// whose reason (`prefetch_refused`, `prefetch_failed`) says that the onload did not happen.
    pub refused: Option<(String, u64)>,
    /// The components offloaded by this decision, with their sizes, in the order they moved.
    pub offloaded: Vec<(String, u64)>,
    /// Available bytes before the decision's first move.
    pub available: Option<u64>,
    /// Peak bytes before the decision's first move.
    pub peak: Option<u64>,
    /// The reason column: empty for a plain onload.
    pub reason: String,
    /// The group's read of its host copy from a file ([`OffloadEvent::read`]), printed after the reason.
    pub read: Option<FileRead>,
    /// The device the group was copied from, where not the host ([`OffloadEvent::from_peer`]), printed after the
    /// reason.
    pub from_peer: Option<String>,
}

/// A shared, bounded record of moves. Cloning shares it: the manager and every group offloader write into one.
///
/// The lock inside protects only the event list; it is taken for a push or a copy, never while a move runs.
#[derive(Clone, Default)]
pub struct OffloadRecord {
    events: Arc<Mutex<Events>>,
}

#[derive(Default)]
struct Events {
    kept: VecDeque<OffloadEvent>,
    /// Events added since the last clear, dropped ones included.
    added: u64,
    /// Refused moves added since the last clear, dropped ones included.
    refused: u64,
}

impl std::ops::Deref for Events {
    type Target = VecDeque<OffloadEvent>;

    fn deref(&self) -> &Self::Target {
        &self.kept
    }
}

impl fmt::Debug for OffloadRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OffloadRecord").field("events", &self.len()).finish()
    }
}

impl OffloadRecord {
    /// An empty record.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends an event, dropping the oldest past [`MAX_EVENTS`].
    pub fn add(&self, event: OffloadEvent) {
        let mut events = self.events.lock();
        if events.kept.len() == MAX_EVENTS {
            events.kept.pop_front();
        }
        events.refused += u64::from(event.is_refusal());
        events.kept.push_back(event);
        events.added += 1;
    }

    /// A record holding `events`, oldest first (past [`MAX_EVENTS`], the newest): what
    /// [`decisions`](Self::decisions) and [`group_moves`](Self::group_moves) return, detached from the record
    /// they were taken from.
    pub fn from_events(events: impl IntoIterator<Item = OffloadEvent>) -> Self {
        let record = Self::new();
        for event in events {
            record.add(event);
        }
        record
    }

    /// Forgets every event.
    pub fn clear(&self) {
        let mut events = self.events.lock();
        events.kept.clear();
        events.added = 0;
        events.refused = 0;
    }

    /// Events added since the last clear, including those dropped past [`MAX_EVENTS`].
    pub fn total_added(&self) -> u64 {
        self.events.lock().added
    }

    /// How many events are kept.
    pub fn len(&self) -> usize {
        self.events.lock().len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.events.lock().is_empty()
    }

    /// A copy of the events, oldest first.
    pub fn events(&self) -> Vec<OffloadEvent> {
        self.events.lock().iter().cloned().collect()
    }

    /// The table's rows as data: one per decision or group move, exactly as [`Display`](fmt::Display) prints them.
    pub fn rows(&self) -> Vec<RecordRow> {
        rows_of(&self.events())
    }

    /// The manager's decisions alone (whole components onloaded, offloaded to make room, retried, disabled), as a
    /// copy detached from this record: its table is the anchor's, one row per decision, whatever streamed beside
    /// them. A model under group offload makes a few moves per forward and thousands per image; they are left out
    /// here and kept in [`group_moves`](Self::group_moves).
    pub fn decisions(&self) -> OffloadRecord {
        Self::from_events(self.events.lock().iter().filter(|e| !e.is_group_move()).cloned())
    }

    /// The group offloaders' moves alone (`group_onload`, `prefetch`, `group_offload`, the groups given back for an
    /// `oom_retry`, and the refused prefetches), as a copy detached from this record.
    pub fn group_moves(&self) -> OffloadRecord {
        Self::from_events(self.events.lock().iter().filter(|e| e.is_group_move()).cloned())
    }

    /// The refused moves kept (`prefetch_refused`, `prefetch_failed`), oldest first.
    pub fn refusals(&self) -> Vec<OffloadEvent> {
        self.events.lock().iter().filter(|e| e.is_refusal()).cloned().collect()
    }

    /// Refused moves added since the last clear, including those dropped past [`MAX_EVENTS`].
    pub fn total_refused(&self) -> u64 {
        self.events.lock().refused
    }

    /// The refusals among the events added after `mark` (a [`total_added`](Self::total_added) read before), or
    /// `None` when there were none: what a program prints after each image, in one line
    /// ([`Refusals`]' `Display`), so that a refusal is never seen only in the statistics.
    ///
    /// ```
    /// use offload_core::{Action, OffloadEvent, OffloadRecord, Reason};
    ///
    /// let record = OffloadRecord::new();
    /// let mark = record.total_added();
    /// // ... one image runs; a group offloader's prefetch is refused:
    /// record.add(OffloadEvent {
    ///     action: Action::Refused,
    ///     id: "unet/up_blocks.0.resnets_0_0".into(),
    ///     bytes: 130_048,
    ///     reason: Some(Reason::PrefetchRefused),
    ///     available: Some(100_000),
    ///     peak: Some(900_000),
    ///     read: None,
    ///     from_peer: None,
    /// });
    /// let refusals = record.refusals_since(mark).expect("one refusal");
    /// assert_eq!(refusals.count, 1);
    /// println!("image 1: {refusals}");
    /// # assert!(record.refusals_since(record.total_added()).is_none());
    /// ```
    pub fn refusals_since(&self, mark: u64) -> Option<Refusals> {
        let events = self.events.lock();
        let since = usize::try_from(events.added.saturating_sub(mark)).unwrap_or(usize::MAX);
        let skip = events.kept.len().saturating_sub(since);
        Refusals::of(events.kept.iter().skip(skip))
    }

    /// The number of offload events, by component id.
    pub fn offload_counts(&self) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for event in self.events.lock().iter().filter(|e| e.action == Action::Offload) {
            *counts.entry(event.id.clone()).or_insert(0) += 1;
        }
        counts
    }
}

/// The refused moves of a stretch of a run, summed for the one line a program prints after an image
/// ([`OffloadRecord::refusals_since`]) and a group offloader logs after a forward.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Refusals {
    /// How many moves were refused.
    pub count: u64,
    /// Of those, how many failed for another reason than memory (`prefetch_failed`).
    pub failed: u64,
    /// Their bytes, summed.
    pub bytes: u64,
    /// The least available of the readings they were refused on, where readings were taken.
    pub least_available: Option<u64>,
    /// The models whose prefetches were refused (the part of each group's id before its `/`), in the order they
    /// were first refused, each with its count.
    pub models: Vec<(String, u64)>,
}

impl Refusals {
    /// Counts `event` when it is a refusal ([`OffloadEvent::is_refusal`]); any other event is left out.
    pub fn add(&mut self, event: &OffloadEvent) {
        if !event.is_refusal() {
            return;
        }
        self.count += 1;
        self.failed += u64::from(event.reason == Some(Reason::PrefetchFailed));
        self.bytes += event.bytes;
        self.least_available = match (self.least_available, event.available) {
            (Some(least), Some(available)) => Some(least.min(available)),
            (least, available) => least.or(available),
        };
        let model = event.id.split('/').next().unwrap_or(&event.id);
        match self.models.iter_mut().find(|(m, _)| m == model) {
            Some((_, count)) => *count += 1,
            None => self.models.push((model.to_string(), 1)),
        }
    }

    /// Whether nothing was refused.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn of<'a>(events: impl Iterator<Item = &'a OffloadEvent>) -> Option<Self> {
        let mut refusals = Refusals::default();
        for event in events {
            refusals.add(event);
        }
        (!refusals.is_empty()).then_some(refusals)
    }
}

impl fmt::Display for Refusals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let models: Vec<String> = self.models.iter().map(|(model, count)| format!("{model} {count}")).collect();
        let prefetches = if self.count == 1 { "prefetch" } else { "prefetches" };
        write!(f, "{} {prefetches} refused ({}; {} in all", self.count, models.join(", "), format_size(self.bytes))?;
        if self.failed > 0 {
            write!(f, "; {} of them failed for another reason than memory, see the log", self.failed)?;
        }
        if let Some(available) = self.least_available {
            write!(f, "; as little as {} available", format_size(available))?;
        }
        write!(
            f,
            "): each group was loaded when its forward took it, so the output is right but those copies were not \
             hidden; the record's prefetch_refused rows hold each reading; make room for the model's window: a \
             reserve that covers its call's activations, fewer components resident beside it, a smaller prefetch \
             depth or leaf level, or a larger card"
        )
    }
}

fn rows_of(events: &[OffloadEvent]) -> Vec<RecordRow> {
    let mut rows = Vec::new();
    // Offloads that make room for an onload come before it; they wait here until it arrives.
    let mut pending: Vec<(String, Vec<&OffloadEvent>)> = Vec::new();
    // The components the events so far leave resident: an offload that made room for one of them made room for
    // what its call streams (a model under group offload, already onloaded), and no onload of it will come.
    let mut resident: HashSet<&str> = HashSet::new();
    for event in events {
        match event.action {
            Action::Onload => {
                resident.insert(event.id.as_str());
            }
            Action::Offload => {
                resident.remove(event.id.as_str());
            }
            Action::Refused => {}
        }
        match (&event.action, &event.reason) {
            (Action::Refused, reason) => rows.push(RecordRow {
                onload: None,
                refused: Some((event.id.clone(), event.bytes)),
                offloaded: Vec::new(),
                available: event.available,
                peak: event.peak,
                reason: reason.as_ref().map(ToString::to_string).unwrap_or_default(),
                read: event.read,
                from_peer: event.from_peer.clone(),
            }),
            (Action::Onload, _) => {
                let caused = match pending.iter().position(|(target, _)| *target == event.id) {
                    Some(index) => pending.remove(index).1,
                    None => Vec::new(),
                };
                let first = caused.first().copied().unwrap_or(event);
                rows.push(RecordRow {
                    onload: Some((event.id.clone(), event.bytes)),
                    refused: None,
                    offloaded: caused.iter().map(|e| (e.id.clone(), e.bytes)).collect(),
                    available: first.available,
                    peak: first.peak,
                    reason: event.reason.as_ref().map(ToString::to_string).unwrap_or_default(),
                    read: event.read,
                    from_peer: event.from_peer.clone(),
                });
            }
            (Action::Offload, Some(Reason::ReleaseMemoryFor(target))) if !resident.contains(target.as_str()) => {
                match pending.iter_mut().find(|(t, _)| t == target) {
                    Some((_, list)) => list.push(event),
                    None => pending.push((target.clone(), vec![event])),
                }
            }
            (Action::Offload, reason) => rows.push(RecordRow {
                onload: None,
                refused: None,
                offloaded: vec![(event.id.clone(), event.bytes)],
                available: event.available,
                peak: event.peak,
                reason: reason.as_ref().map(ToString::to_string).unwrap_or_default(),
                read: event.read,
                from_peer: event.from_peer.clone(),
            }),
        }
    }
    for (target, list) in pending {
        for event in list {
            rows.push(RecordRow {
                onload: None,
                refused: None,
                offloaded: vec![(event.id.clone(), event.bytes)],
                available: event.available,
                peak: event.peak,
                reason: format!("release_memory_for:{target}"),
                read: event.read,
                from_peer: event.from_peer.clone(),
            });
        }
    }
    rows
}

fn label(id: &str, sizes: &HashMap<&str, u64>) -> String {
    format!("{id} ({})", sizes.get(id).map_or_else(|| "-".to_string(), |b| format_size(*b)))
}

/// Formats rows as the anchor's `format_table`: every column padded to its widest cell except the last, cells
/// joined by `" | "`, trailing spaces stripped.
pub fn format_table(headers: &[&str], rows: &[Vec<String>]) -> Vec<String> {
    let columns = headers.len();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate().take(columns) {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let padded: Vec<String> = cells
            .enumerate()
            .map(|(i, cell)| if i + 1 == columns { cell.to_string() } else { format!("{cell:<w$}", w = widths[i]) })
            .collect();
        padded.join(" | ").trim_end().to_string()
    };
    let mut lines = vec![line(&mut headers.iter().copied())];
    for row in rows {
        lines.push(line(&mut row.iter().map(String::as_str)));
    }
    lines
}

/// The headers of the record's table, the anchor's.
const HEADERS: [&str; 6] = ["#", "Onload", "Offloaded", "Available", "Peak", "Reason"];

impl OffloadRecord {
    /// The cells of the record's table, one row per decision or group move, numbered from 1.
    fn table_cells(&self, events: &[OffloadEvent]) -> Vec<Vec<String>> {
        // The last size seen for an id labels it everywhere, as the anchor does.
        let mut sizes: HashMap<&str, u64> = HashMap::new();
        for event in events {
            sizes.insert(event.id.as_str(), event.bytes);
        }
        let size = |b: Option<u64>| b.map_or_else(|| "-".to_string(), format_size);
        rows_of(events)
            .into_iter()
            .enumerate()
            .map(|(i, row)| {
                let offloaded: Vec<String> = row.offloaded.iter().map(|(id, _)| label(id, &sizes)).collect();
                vec![
                    (i + 1).to_string(),
                    row.onload
                        .as_ref()
                        .or(row.refused.as_ref())
                        .map_or_else(|| "-".to_string(), |(id, _)| label(id, &sizes)),
                    if offloaded.is_empty() { "-".to_string() } else { offloaded.join(", ") },
                    size(row.available),
                    size(row.peak),
                    match (row.read, &row.from_peer) {
                        (Some(read), _) => format!("{}, {read}", row.reason),
                        (None, Some(peer)) => format!("{}, from {peer}", row.reason),
                        (None, None) => row.reason,
                    },
                ]
            })
            .collect()
    }
}

/// Writes a table's lines with the dash line under the header, as the anchor prints it.
fn write_table(f: &mut fmt::Formatter<'_>, lines: &[String]) -> fmt::Result {
    writeln!(f, "{}", lines[0])?;
    write!(f, "{}", "-".repeat(lines[0].chars().count()))?;
    for line in &lines[1..] {
        write!(f, "\n{line}")?;
    }
    Ok(())
}

impl fmt::Display for OffloadRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let events = self.events();
        if events.is_empty() {
            return f.write_str("Offload record: nothing recorded yet");
        }
        write_table(f, &format_table(&HEADERS, &self.table_cells(&events)))
    }
}

/// The records of several devices as one table, a `Device` column first: each device's rows in its own order
/// (numbered per device), device after device. Each device has its own manager and record
/// ([`crate::ComponentsManager::offload_record`]); this is how a run over several devices is shown at once.
#[derive(Clone, Default)]
pub struct DeviceRecords {
    records: Vec<(crate::DeviceName, OffloadRecord)>,
}

impl DeviceRecords {
    /// The records, each with the device its moves were onto, in the order to print them.
    pub fn new(records: impl IntoIterator<Item = (crate::DeviceName, OffloadRecord)>) -> Self {
        Self { records: records.into_iter().collect() }
    }

    /// The same devices' records of the managers' decisions alone ([`OffloadRecord::decisions`]).
    pub fn decisions(&self) -> Self {
        Self { records: self.records.iter().map(|(device, record)| (device.clone(), record.decisions())).collect() }
    }

    /// Each device with its record.
    pub fn records(&self) -> &[(crate::DeviceName, OffloadRecord)] {
        &self.records
    }
}

impl fmt::Display for DeviceRecords {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut cells: Vec<Vec<String>> = Vec::new();
        for (device, record) in &self.records {
            let events = record.events();
            cells.extend(record.table_cells(&events).into_iter().map(|row| {
                let mut row = row;
                row.insert(0, device.to_string());
                row
            }));
        }
        if cells.is_empty() {
            return f.write_str("Offload record: nothing recorded yet on any device");
        }
        let mut headers = vec!["Device"];
        headers.extend(HEADERS);
        write_table(f, &format_table(&headers, &cells))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two devices' records as one table: a device column first, each device's rows numbered in its own order.
    #[test]
    fn several_devices_records_print_as_one_table_with_a_device_column() {
        let card = OffloadRecord::new();
        card.add(event(Action::Onload, "transformer_2", 3 << 20, None, 5 << 20, 0));
        card.add(event(Action::Onload, "vae_3", 1 << 20, None, 2 << 20, 3 << 20));
        let second = OffloadRecord::new();
        second.add(event(Action::Onload, "text_encoder_1", 2 << 20, None, 4 << 20, 0));
        let devices = DeviceRecords::new([
            (crate::DeviceName::parse("cuda:0").unwrap(), card),
            (crate::DeviceName::parse("cuda:1").unwrap(), second),
        ]);
        expect_test::expect![[r#"
            Device | # | Onload                   | Offloaded | Available | Peak    | Reason
            --------------------------------------------------------------------------------
            cuda:0 | 1 | transformer_2 (3.00 MB)  | -         | 5.00 MB   | 0 B     |
            cuda:0 | 2 | vae_3 (1.00 MB)          | -         | 2.00 MB   | 3.00 MB |
            cuda:1 | 1 | text_encoder_1 (2.00 MB) | -         | 4.00 MB   | 0 B     |"#]]
        .assert_eq(&devices.to_string());
        assert_eq!(DeviceRecords::default().to_string(), "Offload record: nothing recorded yet on any device");
    }

    const GIB: f64 = (1u64 << 30) as f64;

    fn gib(x: f64) -> u64 {
        (x * GIB) as u64
    }

    fn event(action: Action, id: &str, bytes: u64, reason: Option<Reason>, available: u64, peak: u64) -> OffloadEvent {
        OffloadEvent {
            action,
            id: id.into(),
            bytes,
            reason,
            available: Some(available),
            peak: Some(peak),
            read: None,
            from_peer: None,
        }
    }

    /// The 20GB table from the anchor's docs, rebuilt from its events, byte for byte (no closing dash line).
    #[test]
    fn reproduces_the_anchor_docs_table() {
        let record = OffloadRecord::new();
        let te = "text_encoder_129824856400544";
        let tr = "transformer_129824854851072";
        let vae = "vae_129824905851968";
        record.add(event(Action::Onload, te, 8_044_936_192, None, gib(18.02), 8704));
        record.add(event(
            Action::Offload,
            te,
            8_044_936_192,
            Some(Reason::ReleaseMemoryFor(tr.into())),
            gib(10.384),
            gib(7.77),
        ));
        record.add(event(Action::Onload, tr, 12_309_817_472, None, gib(17.9), gib(7.8)));
        record.add(event(Action::Onload, vae, 167_639_366, None, gib(6.36), gib(12.07)));
        let expected = "\
# | Onload                                 | Offloaded                              | Available | Peak     | Reason
-------------------------------------------------------------------------------------------------------------------
1 | text_encoder_129824856400544 (7.49 GB) | -                                      | 18.02 GB  | 8.50 KB  |
2 | transformer_129824854851072 (11.46 GB) | text_encoder_129824856400544 (7.49 GB) | 10.38 GB  | 7.77 GB  |
3 | vae_129824905851968 (159.87 MB)        | -                                      | 6.36 GB   | 12.07 GB |";
        assert_eq!(record.to_string(), expected);
    }

    #[test]
    fn oom_and_disable_rows_stand_alone_and_leftovers_come_last() {
        let record = OffloadRecord::new();
        record.add(event(Action::Onload, "a_1", 4096, None, 70 * 1024, 0));
        record.add(event(Action::Offload, "b_2", 2048, Some(Reason::OomRetry("a_1".into())), 1024, 4096));
        record.add(event(Action::Offload, "c_3", 1024, Some(Reason::ReleaseMemoryFor("d_4".into())), 1024, 4096));
        record.add(event(Action::Offload, "a_1", 4096, Some(Reason::OffloadingDisabled), 2048, 4096));
        let expected = "\
# | Onload        | Offloaded     | Available | Peak    | Reason
----------------------------------------------------------------
1 | a_1 (4.00 KB) | -             | 70.00 KB  | 0 B     |
2 | -             | b_2 (2.00 KB) | 1.00 KB   | 4.00 KB | oom_retry:a_1
3 | -             | a_1 (4.00 KB) | 2.00 KB   | 4.00 KB | offloading_disabled
4 | -             | c_3 (1.00 KB) | 1.00 KB   | 4.00 KB | release_memory_for:d_4";
        assert_eq!(record.to_string(), expected);
        let rows = record.rows();
        assert_eq!(rows.len(), 4);
        assert_eq!(rows[1].reason, "oom_retry:a_1");
        assert_eq!(rows[3].offloaded, vec![("c_3".to_string(), 1024)]);
    }

    /// A streamed model's group moves and refusals are rows of the record beside the manager's decisions;
    /// `decisions` prints the manager's alone (the anchor's table), `group_moves` the groups', and an offload
    /// that made room for a component already on the device (a streamed model's window) is a row of its own where
    /// it happened, not a leftover waiting for an onload that will never come.
    #[test]
    fn group_moves_and_refusals_are_rows_and_each_kind_prints_apart() {
        let record = OffloadRecord::new();
        let kb = 1024;
        record.add(event(Action::Onload, "unet_2", 16 * kb, None, 84 * kb, 0));
        record.add(event(Action::Onload, "unet_2/blocks_0_0", 8 * kb, Some(Reason::GroupOnload), 84 * kb, 16 * kb));
        record.add(event(Action::Onload, "encoder_1", 60 * kb, None, 76 * kb, 24 * kb));
        record.add(event(Action::Refused, "unet_2/blocks_1_1", 8 * kb, Some(Reason::PrefetchRefused), 4 * kb, 84 * kb));
        record.add(event(
            Action::Offload,
            "encoder_1",
            60 * kb,
            Some(Reason::ReleaseMemoryFor("unet_2".into())),
            4 * kb,
            84 * kb,
        ));
        record.add(event(Action::Offload, "unet_2/blocks_0_0", 8 * kb, Some(Reason::GroupOffload), 64 * kb, 84 * kb));
        let expected = "\
# | Onload                      | Offloaded                   | Available | Peak     | Reason
---------------------------------------------------------------------------------------------
1 | unet_2 (16.00 KB)           | -                           | 84.00 KB  | 0 B      |
2 | unet_2/blocks_0_0 (8.00 KB) | -                           | 84.00 KB  | 16.00 KB | group_onload
3 | encoder_1 (60.00 KB)        | -                           | 76.00 KB  | 24.00 KB |
4 | unet_2/blocks_1_1 (8.00 KB) | -                           | 4.00 KB   | 84.00 KB | prefetch_refused
5 | -                           | encoder_1 (60.00 KB)        | 4.00 KB   | 84.00 KB | release_memory_for:unet_2
6 | -                           | unet_2/blocks_0_0 (8.00 KB) | 64.00 KB  | 84.00 KB | group_offload";
        assert_eq!(record.to_string(), expected);
        let rows = record.rows();
        assert_eq!(rows.len(), 6);
        assert_eq!(rows[3].refused, Some(("unet_2/blocks_1_1".to_string(), 8 * kb)));
        assert_eq!((rows[3].onload.clone(), rows[3].reason.as_str()), (None, "prefetch_refused"));
        assert_eq!((rows[4].onload.clone(), rows[4].reason.as_str()), (None, "release_memory_for:unet_2"));
        let decisions = "\
# | Onload               | Offloaded            | Available | Peak     | Reason
-------------------------------------------------------------------------------
1 | unet_2 (16.00 KB)    | -                    | 84.00 KB  | 0 B      |
2 | encoder_1 (60.00 KB) | -                    | 76.00 KB  | 24.00 KB |
3 | -                    | encoder_1 (60.00 KB) | 4.00 KB   | 84.00 KB | release_memory_for:unet_2";
        assert_eq!(record.decisions().to_string(), decisions);
        assert_eq!(record.group_moves().len(), 3);
        assert_eq!(record.refusals().len(), 1);
        assert_eq!(record.total_refused(), 1);
    }

    /// A group read from a file says so after its reason, with the read's bytes and time; the manager's rows
    /// and the groups held in memory print as before.
    #[test]
    fn a_group_read_from_a_file_says_so_after_its_reason() {
        let record = OffloadRecord::new();
        record.add(event(Action::Onload, "vae_1", 4096, None, 70 * 1024, 0));
        let mut prefetch = event(Action::Onload, "tr_2/layers_0_0", 4096, Some(Reason::Prefetch), 64 * 1024, 4096);
        prefetch.read = Some(FileRead { bytes: 4096, nanos: 1_500_000 });
        record.add(prefetch);
        record.add(event(Action::Offload, "tr_2/layers_0_0", 4096, Some(Reason::GroupOffload), 60 * 1024, 8192));
        let expected = "\
# | Onload                    | Offloaded                 | Available | Peak    | Reason
----------------------------------------------------------------------------------------
1 | vae_1 (4.00 KB)           | -                         | 70.00 KB  | 0 B     |
2 | tr_2/layers_0_0 (4.00 KB) | -                         | 64.00 KB  | 4.00 KB | prefetch, from file: 4.00 KB in 1.5 ms
3 | -                         | tr_2/layers_0_0 (4.00 KB) | 60.00 KB  | 8.00 KB | group_offload";
        assert_eq!(record.to_string(), expected);
        assert_eq!(record.rows()[1].read, Some(FileRead { bytes: 4096, nanos: 1_500_000 }));
        assert_eq!(record.rows()[1].reason, "prefetch");
    }

    /// A group copied from a donor device says so after its reason; a read from a file takes precedence (a move
    /// has one source).
    #[test]
    fn a_group_copied_from_a_donor_names_the_device_after_its_reason() {
        let record = OffloadRecord::new();
        let mut upload = event(Action::Onload, "tr_2/layers_1_1", 4096, Some(Reason::Prefetch), 64 * 1024, 4096);
        upload.from_peer = Some("cuda:1".into());
        record.add(upload);
        assert!(record.to_string().ends_with("| prefetch, from cuda:1"), "{record}");
        assert_eq!(record.rows()[0].from_peer.as_deref(), Some("cuda:1"));
        assert_eq!(record.rows()[0].reason, "prefetch");
    }

    /// `refusals_since` sums the refusals added after a mark, whatever else was added, and is `None` without any.
    #[test]
    fn refusals_since_a_mark_sum_what_was_refused_after_it() {
        let record = OffloadRecord::new();
        let refused = |group: &str, reason: Reason, available: u64| OffloadEvent {
            action: Action::Refused,
            id: group.to_string(),
            bytes: 1000,
            reason: Some(reason),
            available: Some(available),
            peak: Some(0),
            read: None,
            from_peer: None,
        };
        record.add(refused("unet/a", Reason::PrefetchRefused, 10));
        let mark = record.total_added();
        assert_eq!(record.refusals_since(mark), None);
        record.add(event(Action::Onload, "unet/b", 1000, Some(Reason::Prefetch), 5000, 0));
        record.add(refused("unet/c", Reason::PrefetchRefused, 300));
        record.add(refused("dit/a", Reason::PrefetchFailed, 200));
        record.add(refused("unet/d", Reason::PrefetchRefused, 400));
        let refusals = record.refusals_since(mark).expect("three refusals");
        assert_eq!(
            refusals,
            Refusals {
                count: 3,
                failed: 1,
                bytes: 3000,
                least_available: Some(200),
                models: vec![("unet".to_string(), 2), ("dit".to_string(), 1)],
            }
        );
        assert_eq!(
            refusals.to_string(),
            "3 prefetches refused (unet 2, dit 1; 2.93 KB in all; 1 of them failed for another reason than memory, \
             see the log; as little as 200 B available): each group was loaded when its forward took it, so the \
             output is right but those copies were not hidden; the record's prefetch_refused rows hold each \
             reading; make room for the model's window: a reserve that covers its call's activations, fewer \
             components resident beside it, a smaller prefetch depth or leaf level, or a larger card"
        );
        assert_eq!(record.total_refused(), 4);
        record.clear();
        assert_eq!(record.total_refused(), 0);
    }

    #[test]
    fn empty_record_says_so_and_is_bounded() {
        let record = OffloadRecord::new();
        assert_eq!(record.to_string(), "Offload record: nothing recorded yet");
        for i in 0..MAX_EVENTS + 5 {
            record.add(event(Action::Onload, &format!("c_{i}"), 1, None, 1, 1));
        }
        assert_eq!(record.len(), MAX_EVENTS);
        assert_eq!(record.events()[0].id, "c_5");
        let shared = record.clone();
        shared.clear();
        assert!(record.is_empty());
    }
}
