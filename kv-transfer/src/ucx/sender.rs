//! Sending side of the UCX transport: a thread owns the worker and one endpoint to the
//! receiver; async transfers hand it messages through a channel and get replies back.
//! A semaphore per transfer bounds the frames in flight (their buffers stay alive until UCX
//! completes the send), so memory stays bounded whatever the transfer's size.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use pb::kv_receiver_message::Message as Reply;
use pb::kv_sender_message::Message as Outgoing;
use pd_proto::v1 as pb;
use pd_ucx_sys as sys;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use super::worker::{sockaddr, status_error, Worker};
use super::{envelope, UcxConfig, AM_TO_RECEIVER, AM_TO_SENDER};
use crate::error::TransferError;
use crate::wire::{Frame, TransferHeader};
use crate::{CommitReceipt, KvSender, KvTransfer};

/// Frames per transfer handed to UCX and not yet completed.
const FRAMES_IN_FLIGHT: usize = 8;

type ReplyTx = mpsc::UnboundedSender<Result<Reply, TransferError>>;

enum Command {
    Register { id: String, replies: ReplyTx },
    Unregister { id: String },
    Send { header: Vec<u8>, data: Vec<u8>, permit: Option<OwnedSemaphorePermit> },
}

struct Ctx {
    replies: HashMap<String, ReplyTx>,
    failed: Option<TransferError>,
}

impl Ctx {
    fn fail_all(&mut self, err: TransferError) {
        for (_, tx) in self.replies.drain() {
            let _ = tx.send(Err(err.clone()));
        }
        self.failed = Some(err);
    }
}

/// Keeps a send's buffers (and its in-flight permit) alive until UCX completes it.
struct InFlight {
    _header: Vec<u8>,
    _data: Vec<u8>,
    _permit: Option<OwnedSemaphorePermit>,
    ctx: *mut Ctx,
}

unsafe extern "C" fn on_sent(request: *mut std::ffi::c_void, status: sys::ucs_status_t, user: *mut std::ffi::c_void) {
    // SAFETY: `user` is the boxed InFlight leaked at send time; taken back once here.
    let in_flight = unsafe { Box::from_raw(user as *mut InFlight) };
    if status != sys::ucs_status_t::UCS_OK {
        // SAFETY: the Ctx outlives every operation of the worker.
        let ctx = unsafe { &mut *in_flight.ctx };
        ctx.fail_all(status_error("sending to the KV receiver", status));
    }
    // SAFETY: requests handed to callbacks are freed by the application.
    unsafe { sys::ucp_request_free(request) };
}

unsafe extern "C" fn on_reply(
    arg: *mut std::ffi::c_void,
    header: *const std::ffi::c_void,
    header_length: usize,
    _data: *mut std::ffi::c_void,
    _length: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is our Ctx; the header is `header_length` bytes valid during the call.
    let (ctx, header) =
        unsafe { (&mut *(arg as *mut Ctx), std::slice::from_raw_parts(header as *const u8, header_length)) };
    if let Ok((id, reply)) = envelope::decode::<pb::KvReceiverMessage>(header) {
        if let (Some(tx), Some(message)) = (ctx.replies.get(&id), reply.message) {
            let _ = tx.send(Ok(message));
        }
    }
    sys::ucs_status_t::UCS_OK
}

unsafe extern "C" fn on_ep_error(arg: *mut std::ffi::c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` is our Ctx.
    let ctx = unsafe { &mut *(arg as *mut Ctx) };
    ctx.fail_all(status_error("the KV receiver's endpoint failed", status));
}

struct Shared {
    commands: Mutex<std_mpsc::Sender<Command>>,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.get_mut().ok().and_then(Option::take) {
            let _ = thread.join();
        }
    }
}

/// Opens transfers to one receiver over UCX. Cloning shares the connection.
#[derive(Clone)]
pub struct UcxKvSender {
    shared: Arc<Shared>,
    timeout: Duration,
}

impl std::fmt::Debug for UcxKvSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UcxKvSender")
    }
}

impl UcxKvSender {
    /// Connects to a `UcxKvReceiver` at `addr`.
    pub async fn connect(addr: SocketAddr, config: UcxConfig, timeout: Duration) -> Result<Self, TransferError> {
        let (tx, rx) = std_mpsc::channel();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let shared =
            Arc::new(Shared { commands: Mutex::new(tx), stop: AtomicBool::new(false), thread: Mutex::new(None) });
        let stop_ref = Arc::downgrade(&shared);
        let thread = std::thread::Builder::new()
            .name("pd-ucx-sender".into())
            .spawn(move || run(addr, config, rx, stop_ref, ready_tx))
            .map_err(|e| TransferError::Transport(format!("starting the UCX thread: {e}")))?;
        if let Ok(mut slot) = shared.thread.lock() {
            *slot = Some(thread);
        }
        tokio::time::timeout(timeout, ready_rx)
            .await
            .map_err(|_| TransferError::Timeout(timeout, "the UCX endpoint"))?
            .map_err(|_| TransferError::Transport("the UCX thread ended".into()))??;
        Ok(UcxKvSender { shared, timeout })
    }

    fn command(&self, command: Command) -> Result<(), TransferError> {
        self.shared
            .commands
            .lock()
            .map_err(|_| TransferError::Transport("UCX command channel poisoned".into()))?
            .send(command)
            .map_err(|_| TransferError::Transport("the UCX thread ended".into()))
    }
}

fn message(id: &str, m: Outgoing) -> Vec<u8> {
    envelope::encode(id, &pb::KvSenderMessage { message: Some(m) })
}

fn refusal(reply: Option<Result<Reply, TransferError>>) -> TransferError {
    match reply {
        Some(Ok(Reply::Refused(r))) => TransferError::from_refusal(&r.kind, r.reason),
        Some(Ok(other)) => TransferError::Protocol(format!("unexpected reply {other:?}")),
        Some(Err(e)) => e,
        None => TransferError::Transport("the UCX thread ended".into()),
    }
}

impl KvSender for UcxKvSender {
    type Transfer = UcxTransfer;

    async fn start(&self, header: TransferHeader) -> Result<UcxTransfer, TransferError> {
        let id = header.transfer_id.clone();
        let (tx, mut replies) = mpsc::unbounded_channel();
        self.command(Command::Register { id: id.clone(), replies: tx })?;
        let open = message(&id, Outgoing::Header(header.to_pb()));
        self.command(Command::Send { header: open, data: Vec::new(), permit: None })?;
        let reply = tokio::time::timeout(self.timeout, replies.recv())
            .await
            .map_err(|_| TransferError::Timeout(self.timeout, "the receiver to accept the header"))?;
        match reply {
            Some(Ok(Reply::Accepted(_))) => Ok(UcxTransfer {
                id,
                sender: self.clone(),
                replies,
                window: Arc::new(Semaphore::new(FRAMES_IN_FLIGHT)),
            }),
            other => {
                let _ = self.command(Command::Unregister { id });
                Err(refusal(other))
            }
        }
    }
}

/// One transfer in flight over UCX.
#[derive(Debug)]
pub struct UcxTransfer {
    id: String,
    sender: UcxKvSender,
    replies: mpsc::UnboundedReceiver<Result<Reply, TransferError>>,
    window: Arc<Semaphore>,
}

impl UcxTransfer {
    async fn push(&mut self, header: Vec<u8>, data: Vec<u8>, what: &'static str) -> Result<(), TransferError> {
        let timeout = self.sender.timeout;
        let permit = tokio::select! {
            permit = tokio::time::timeout(timeout, self.window.clone().acquire_owned()) => permit
                .map_err(|_| TransferError::Timeout(timeout, what))?
                .map_err(|_| TransferError::Transport("transfer window closed".into()))?,
            reply = self.replies.recv() => return Err(refusal(reply)),
        };
        // An early refusal or a failed endpoint wins over queueing more data.
        if let Ok(reply) = self.replies.try_recv() {
            return Err(refusal(Some(reply)));
        }
        self.sender.command(Command::Send { header, data, permit: Some(permit) })
    }
}

impl Drop for UcxTransfer {
    fn drop(&mut self) {
        let _ = self.sender.command(Command::Unregister { id: self.id.clone() });
    }
}

impl KvTransfer for UcxTransfer {
    async fn send(&mut self, frame: Frame) -> Result<(), TransferError> {
        let Frame { layer, first_block, block_count, checksum, data } = frame;
        let header = message(
            &self.id,
            Outgoing::Frame(pb::KvFrame { layer, first_block, block_count, checksum, data: Vec::new() }),
        );
        self.push(header, data, "room to send a frame").await
    }

    async fn commit(mut self, commit: pb::KvCommit) -> Result<CommitReceipt, TransferError> {
        let header = message(&self.id, Outgoing::Commit(commit));
        self.push(header, Vec::new(), "room to send the commit").await?;
        let timeout = self.sender.timeout;
        let reply = tokio::time::timeout(timeout, self.replies.recv())
            .await
            .map_err(|_| TransferError::Timeout(timeout, "the commit confirmation"))?;
        match reply {
            Some(Ok(Reply::Committed(c))) => Ok(CommitReceipt { bytes: c.bytes, frames: c.frames }),
            other => Err(refusal(other)),
        }
    }

    async fn abort(mut self, reason: &str) {
        let header = message(&self.id, Outgoing::Abort(pb::KvAbort { reason: reason.to_string() }));
        let _ = self.push(header, Vec::new(), "room to send the abort").await;
        // Let the abort leave before the transfer's window closes.
        let _ = tokio::time::timeout(self.sender.timeout, self.window.acquire_many(FRAMES_IN_FLIGHT as u32)).await;
    }
}

fn run(
    addr: SocketAddr,
    config: UcxConfig,
    commands: std_mpsc::Receiver<Command>,
    shared: std::sync::Weak<Shared>,
    ready: tokio::sync::oneshot::Sender<Result<(), TransferError>>,
) {
    let worker = match Worker::new(&config) {
        Ok(w) => w,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut ctx = Box::new(Ctx { replies: HashMap::new(), failed: None });
    let ctx_ptr = &mut *ctx as *mut Ctx as *mut std::ffi::c_void;
    if let Err(e) = worker.set_am_handler(AM_TO_SENDER, Some(on_reply), ctx_ptr) {
        let _ = ready.send(Err(e));
        return;
    }
    let ep = match connect(&worker, addr, ctx_ptr) {
        Ok(ep) => ep,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let mut idle_rounds = 0u32;
    loop {
        let stopping = shared.upgrade().is_none_or(|s| s.stop.load(Ordering::Acquire));
        if stopping {
            break;
        }
        let mut busy = false;
        while worker.progress() {
            busy = true;
        }
        while let Ok(command) = commands.try_recv() {
            busy = true;
            handle(command, ep, &mut ctx);
        }
        if busy {
            idle_rounds = 0;
        } else {
            idle_rounds = idle_rounds.saturating_add(1);
            if idle_rounds > 64 {
                std::thread::sleep(Duration::from_micros(if idle_rounds > 4096 { 1000 } else { 50 }));
            }
        }
    }
    worker.close_ep(ep);
    drop(worker);
    drop(ctx);
}

/// Opens the endpoint to the receiver at `addr`, with `ctx_ptr` for its error handler.
fn connect(worker: &Worker, addr: SocketAddr, ctx_ptr: *mut std::ffi::c_void) -> Result<sys::ucp_ep_h, TransferError> {
    let (storage, len) = sockaddr(addr);
    let mut params = sys::ucp_ep_params_t {
        field_mask: (sys::UCP_EP_PARAM_FIELD_FLAGS
            | sys::UCP_EP_PARAM_FIELD_SOCK_ADDR
            | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
            | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
        flags: sys::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
        sockaddr: sys::ucs_sock_addr_t { addr: &storage as *const _ as *const sys::sockaddr, addrlen: len },
        err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
        ..Default::default()
    };
    params.err_handler.cb = Some(on_ep_error);
    params.err_handler.arg = ctx_ptr;
    let mut ep: sys::ucp_ep_h = ptr::null_mut();
    // SAFETY: valid worker and params; `storage` outlives the call.
    let status = unsafe { sys::ucp_ep_create(worker.worker, &params, &mut ep) };
    if status != sys::ucs_status_t::UCS_OK {
        return Err(status_error(&format!("connecting to {addr}"), status));
    }
    Ok(ep)
}

/// One command from the transfers, on the worker thread.
fn handle(command: Command, ep: sys::ucp_ep_h, ctx: &mut Ctx) {
    match command {
        Command::Register { id, replies } => {
            if let Some(err) = &ctx.failed {
                let _ = replies.send(Err(err.clone()));
            } else {
                ctx.replies.insert(id, replies);
            }
        }
        Command::Unregister { id } => {
            ctx.replies.remove(&id);
        }
        // After a failure every transfer was already told: nothing more is sent.
        Command::Send { .. } if ctx.failed.is_some() => {}
        Command::Send { header, data, permit } => send(ep, header, data, permit, ctx),
    }
}

fn send(ep: sys::ucp_ep_h, header: Vec<u8>, data: Vec<u8>, permit: Option<OwnedSemaphorePermit>, ctx: &mut Ctx) {
    let (header_ptr, header_len) = (header.as_ptr(), header.len());
    let (data_ptr, data_len) = (data.as_ptr(), data.len());
    let ctx_ptr = ctx as *mut Ctx;
    let user = Box::into_raw(Box::new(InFlight { _header: header, _data: data, _permit: permit, ctx: ctx_ptr }));
    let mut params = sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA | sys::UCP_OP_ATTR_FIELD_FLAGS,
        flags: sys::UCP_AM_SEND_FLAG_REPLY,
        user_data: user as *mut std::ffi::c_void,
        ..Default::default()
    };
    params.cb.send = Some(on_sent);
    // SAFETY: the buffers live in the boxed InFlight until on_sent (or below) frees it.
    let request = unsafe {
        sys::ucp_am_send_nbx(
            ep,
            AM_TO_RECEIVER,
            header_ptr as *const _,
            header_len,
            data_ptr as *const _,
            data_len,
            &params,
        )
    };
    if !sys::ucs_ptr_is_ptr(request) {
        // SAFETY: completed at once or failed: the callback will not run; the box is ours.
        drop(unsafe { Box::from_raw(user) });
        if sys::ucs_ptr_is_err(request) {
            ctx.fail_all(TransferError::Transport(format!(
                "UCX send failed (status {})",
                sys::ucs_ptr_status(request)
            )));
        }
    }
}
