//! Uploads: a device's one upload thread ([`UploadThread`], owned by its [`OffloadDevice`](crate::OffloadDevice)),
//! where every engine's prefetches and every whole component's onload copy run, and the device tensors an upload
//! builds ([`DeviceTensor`]).

use std::any::Any;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;

use burn::tensor::{DType, Device, Tensor, TensorData};
use offload_core::DeviceName;
use parking_lot::Mutex;

use crate::error::{Error, Result};

/// A unit of work for a device's shared upload thread.
pub(crate) type Task = Box<dyn FnOnce() + Send>;

/// One device's upload thread ([`OffloadDevice`](crate::OffloadDevice) owns it): every engine's prefetches on the
/// device, and every whole component's onload copy ([`UploadThread::run`]), so that all weights share its pools.
/// Started at its first use (named `group-offload-uploads-<device>`, so the checks it makes count as a worker's),
/// and ended when its device object is dropped.
///
/// Why one per device: cubecl gives each thread a stream, and each stream its own pools. Its exclusive pool
/// (`PagePolicy::Exclusive`) sizes a new page to the larger of the request and a running average of its
/// bucket's requests, which starts at half the bucket's largest size and moves 1% toward each request. On a new
/// stream a tensor of a few KB therefore takes a page of about 16 KB, and so does each uniform buffer of the
/// upload check's launches, until some hundreds of requests have passed. Measured on lavapipe with a new worker
/// per model: a streamed text encoder's worker held 341 KB of pages for 37 KB of tensors and 241 KB of uniform
/// pages for 896 B (`docs/devices.md`).
pub(crate) struct UploadThread {
    /// The device's name, for the thread's name and the errors.
    name: DeviceName,
    /// The task queue and the thread, once started.
    worker: Mutex<Option<(mpsc::Sender<Task>, JoinHandle<()>)>>,
}

impl UploadThread {
    /// The upload thread of the device called `name`, not started yet.
    pub fn new(name: DeviceName) -> Self {
        Self { name, worker: Mutex::new(None) }
    }

    /// The thread's task queue, starting the thread at the first call (or again if it ended: it catches its
    /// tasks' panics, so none should end).
    pub fn sender(&self) -> std::io::Result<mpsc::Sender<Task>> {
        let mut worker = self.worker.lock();
        if let Some((sender, thread)) = worker.as_ref()
            && !thread.is_finished()
        {
            return Ok(sender.clone());
        }
        let (sender, tasks) = mpsc::channel::<Task>();
        let thread_name = upload_thread_name(&self.name);
        let thread = std::thread::Builder::new().name(thread_name.clone()).spawn(move || {
            while let Ok(task) = tasks.recv() {
                serve(&thread_name, task);
            }
        })?;
        *worker = Some((sender.clone(), thread));
        Ok(sender)
    }

    /// Whether the thread has started (and not ended): whether its stream can hold any pages.
    pub fn is_started(&self) -> bool {
        self.worker.lock().as_ref().is_some_and(|(_, thread)| !thread.is_finished())
    }

    /// Whether the calling thread is this upload thread.
    fn is_current(&self) -> bool {
        let worker = self.worker.lock();
        worker.as_ref().is_some_and(|(_, thread)| thread.thread().id() == std::thread::current().id())
    }

    /// Runs `f` on the upload thread and waits for what it returns: how a whole component's onload puts its weights
    /// in the same stream's pools as the groups streamed on that device, so that the footprint it measures is what
    /// those pools take for the weights. A panic in `f` is caught on the thread, which goes on serving the other
    /// engines, and comes back to the caller as [`Error::UploadPanicked`] (`f` gives back what it reserved as it
    /// unwinds); [`Error::UploadThread`] when the thread cannot be started or ended.
    pub fn run<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> Result<R> {
        let what = "a task on the upload thread";
        let name = &self.name;
        let unserved = |problem: String| Error::UploadThread { what: what.into(), device: name.to_string(), problem };
        // On the upload thread itself (a task that uploads again) the work runs here: sending it to this thread's
        // own queue and waiting would wait for ever. Its panic is the outer task's, reported to that task's waiter.
        if self.is_current() {
            return Ok(f());
        }
        let (sender, result) = mpsc::sync_channel(1);
        let task: Task = Box::new(move || {
            let _ = sender.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
        });
        self.sender()
            .map_err(|e| unserved(format!("it cannot be started: {e}")))?
            .send(task)
            .map_err(|_| unserved("it has ended".into()))?;
        match result.recv() {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(payload)) => {
                let message = crate::error::panic_text(payload.as_ref());
                tracing::error!(device = %name, "a task panicked on the upload thread ({message}); the thread goes on");
                Err(Error::UploadPanicked { what: what.into(), device: name.to_string(), message })
            }
            Err(_) => Err(unserved("it ended before the task ran".into())),
        }
    }
}

impl Drop for UploadThread {
    /// Closes the thread's queue: the thread ends once the last sender is gone (an engine's, which it holds beside
    /// the device, may go after this). It is not joined: a join here could wait on a sender dropped after it, or on
    /// the thread itself when a task held the device's last handle.
    fn drop(&mut self) {
        drop(self.worker.get_mut().take());
    }
}

/// The name of `device`'s upload thread.
fn upload_thread_name(name: &DeviceName) -> String {
    format!("group-offload-uploads-{name}")
}

/// Runs one task on a worker thread (a device's upload thread, or an engine's own), so that a panic in it ends the
/// task and not the thread: the thread goes on serving every other engine on the device, whose prefetches would
/// otherwise all fail from then on. The tasks report their own panics to their waiters, typed (a prefetch as its
/// failure, [`UploadThread::run`] as [`Error::UploadPanicked`]); one that still unwinds this far is logged here.
pub(crate) fn serve(thread: &str, task: impl FnOnce()) {
    if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task)) {
        let message = crate::error::panic_text(payload.as_ref());
        tracing::error!(thread, "a task on the upload thread panicked ({message}); the thread goes on");
    }
}

/// The highest rank of a quantized parameter group offload uploads in its own shape.
pub(crate) const MAX_QUANTIZED_RANK: usize = 6;

/// One parameter on the execution device, as an upload built it.
#[derive(Clone)]
#[allow(
    clippy::large_enum_variant,
    reason = "a group's parameters are built once per upload and installed at once; boxing the float tensor would \
              add a heap allocation per parameter per move for the rarer quantized case's sake"
)]
pub(crate) enum DeviceTensor {
    /// A float parameter, flat: installation reshapes it to the parameter's shape (a view).
    Flat(Tensor<1>),
    /// A quantized parameter in its own shape: a `Tensor<D>` of the parameter's rank `D`, behind `Any` because
    /// the group holds parameters of every rank. Installation takes it as it is: a block-quantized tensor's
    /// scales are laid over its shape, and some backends (`flex`) reshape one by dequantizing and quantizing
    /// again, which would change its values.
    Shaped(Arc<dyn Any + Send + Sync>),
}

impl DeviceTensor {
    /// Whether it is a quantized parameter (kept in its shape).
    pub fn is_quantized(&self) -> bool {
        matches!(self, Self::Shaped(_))
    }

    /// The same parameter copied to `device` (a donor's copy to the execution device, or back); a quantized one,
    /// whose rank is behind `Any`, is not moved this way.
    pub fn to_device(&self, device: &Device) -> Result<Self, String> {
        match self {
            Self::Flat(tensor) => Ok(Self::Flat(tensor.clone().to_device(device))),
            Self::Shaped(_) => {
                Err("a quantized parameter is not copied between devices; it streams from the host".into())
            }
        }
    }

    /// Builds the device tensor of `data` ([`TensorMeta::upload_data`](crate::store::TensorMeta::upload_data)'s
    /// output) on `device`, converted there to `target` when that is another float dtype (a file tensor read in
    /// the file's dtype for a model that runs in another); a quantized tensor is rebuilt from its bytes by the
    /// backend (values and scales as they are).
    pub fn upload(data: TensorData, device: &Device, target: DType) -> Result<Self, String> {
        let dtype = data.dtype();
        if !matches!(dtype, DType::QFloat(_)) {
            let flat = Tensor::<1>::from_data(data, (device, dtype));
            return Ok(Self::Flat(if dtype == target || !target.is_float() { flat } else { flat.cast(target) }));
        }
        fn shaped<const D: usize>(data: TensorData, device: &Device, dtype: DType) -> DeviceTensor {
            DeviceTensor::Shaped(Arc::new(Tensor::<D>::from_data(data, (device, dtype))))
        }
        Ok(match data.shape().num_dims() {
            1 => shaped::<1>(data, device, dtype),
            2 => shaped::<2>(data, device, dtype),
            3 => shaped::<3>(data, device, dtype),
            4 => shaped::<4>(data, device, dtype),
            5 => shaped::<5>(data, device, dtype),
            6 => shaped::<6>(data, device, dtype),
            rank => {
                return Err(format!(
                    "a quantized tensor of rank {rank} cannot be uploaded in its shape (ranks 1 to \
                     {MAX_QUANTIZED_RANK}); leave it unquantized"
                ));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 37, item 7: the device's upload thread survives a task that panics. The panic comes back to the task's
    /// waiter as a typed error, and the next task runs on the same thread (before, the panic went on in the caller
    /// and ended the thread, and every engine on the device lost its prefetches).
    #[test]
    fn the_upload_thread_survives_a_panicking_task_and_reports_it_typed() {
        let uploads = UploadThread::new(DeviceName::parse("cuda:7").expect("a device name"));
        let thread = || std::thread::current().id();
        let before = uploads.run(thread).expect("runs");
        let panicked = uploads.run(|| -> u32 { panic!("a ledger bug") });
        match panicked {
            Err(Error::UploadPanicked { message, device, .. }) => {
                assert_eq!((message.as_str(), device.as_str()), ("a ledger bug", "cuda:7"));
            }
            other => panic!("expected a typed panic, got {other:?}"),
        }
        let after = uploads.run(thread).expect("the thread goes on");
        assert_eq!(before, after, "the same thread served the task after the panic");
        let error = uploads.run(|| -> u32 { panic!("again") }).expect_err("typed");
        assert_eq!(
            error.to_string(),
            "a task on the upload thread for cuda:7 panicked: again; nothing of it stays reserved on the device and \
             the host copy is intact, so running again is safe, but this is a bug outside the device: report it \
             with this message"
        );
    }
}
