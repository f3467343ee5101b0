//! Receiving side of the UCX transport: a thread with a listener and an active-message
//! handler that drives the registry. Frames arrive eagerly (data in the callback) or by
//! rendezvous (received into a staging buffer, then checked and written).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use pb::kv_receiver_message::Message as Reply;
use pb::kv_sender_message::Message as Incoming;
use pd_proto::v1 as pb;
use pd_ucx_sys as sys;

use super::worker::{check, sockaddr, status_error, Worker};
use super::{envelope, UcxConfig, AM_TO_RECEIVER, AM_TO_SENDER};
use crate::error::TransferError;
use crate::receiver::{KvRegistry, SenderId};
use crate::wire::{FrameView, TransferHeader};

/// State the UCX callbacks reach through their `arg` pointer; lives on the receiver thread.
struct Ctx {
    registry: Arc<KvRegistry>,
    worker: sys::ucp_worker_h,
    /// Connection requests from the listener, accepted by the thread loop.
    pending: Vec<sys::ucp_conn_request_h>,
    /// Live endpoints and the transfers each has open, with the sender id the registry gave
    /// each (to name it in later messages and to detach them if the sender dies).
    eps: HashMap<usize, Vec<(String, SenderId)>>,
    /// Endpoints whose peer failed, closed by the thread loop.
    failed: Vec<sys::ucp_ep_h>,
    /// Replies to send after the current progress call.
    replies: Vec<(sys::ucp_ep_h, Vec<u8>)>,
    /// Rendezvous frames still arriving, per transfer. Their headers came before a later
    /// commit, so a commit waits until its transfer has none left.
    arriving: HashMap<String, usize>,
    /// Commits that came while frames were still arriving.
    deferred_commits: HashMap<String, (sys::ucp_ep_h, pb::KvCommit)>,
}

impl Ctx {
    fn reply(&mut self, ep: sys::ucp_ep_h, id: &str, message: Reply) {
        let body = pb::KvReceiverMessage { message: Some(message) };
        self.replies.push((ep, envelope::encode(id, &body)));
    }

    fn refuse(&mut self, ep: sys::ucp_ep_h, id: &str, err: &TransferError) {
        self.reply(ep, id, Reply::Refused(pb::KvRefused { reason: err.to_string(), kind: err.kind().to_string() }));
    }

    /// Handles one message from a sender (frames' data already in `data`).
    fn handle(&mut self, ep: sys::ucp_ep_h, id: String, message: Option<Incoming>, data: &[u8]) {
        match (message, self.sender(ep, &id)) {
            (Some(Incoming::Header(h)), _) => match TransferHeader::from_pb(h).and_then(|h| self.registry.open(&h)) {
                Ok(sender) => {
                    self.forget(ep, &id);
                    self.eps.entry(ep as usize).or_default().push((id.clone(), sender));
                    self.reply(ep, &id, Reply::Accepted(pb::KvAccepted { max_frames_in_flight: 0 }));
                }
                Err(e) => {
                    let e = self.registry.reject(&id, None, e);
                    self.refuse(ep, &id, &e);
                }
            },
            (None, sender) => {
                let e = self.registry.reject(&id, sender, TransferError::Protocol("empty message".into()));
                self.refuse(ep, &id, &e);
            }
            // Nothing of this endpoint's is open under `id` (never opened, or already ended):
            // refused, and the transfer, which may be another sender's, is left alone.
            (Some(_), None) => {
                let e = TransferError::Protocol("a frame, commit or abort before the header".into());
                self.refuse(ep, &id, &e);
            }
            (Some(message), Some(sender)) => self.handle_open(ep, id, sender, message, data),
        }
    }

    /// Handles a frame, commit or abort of a transfer that `ep` opened as `sender`.
    fn handle_open(&mut self, ep: sys::ucp_ep_h, id: String, sender: SenderId, message: Incoming, data: &[u8]) {
        match message {
            Incoming::Header(_) => {} // handled by `handle`
            Incoming::Frame(f) => {
                let view = FrameView {
                    layer: f.layer,
                    first_block: f.first_block,
                    block_count: f.block_count,
                    checksum: f.checksum,
                    data,
                };
                if let Err(e) = self.registry.apply_frame_view(&id, sender, view) {
                    // A superseded sender keeps its entry until its commit or abort (or its
                    // endpoint's end), so those are refused as superseded too, not as messages
                    // without a header: which refusal its commit reports must not depend on
                    // whether the frame's refusal reached it first.
                    if !matches!(e, TransferError::Superseded(_)) {
                        self.forget(ep, &id);
                    }
                    self.refuse(ep, &id, &e);
                }
            }
            Incoming::Commit(c) if self.arriving.get(&id).copied().unwrap_or(0) > 0 => {
                self.deferred_commits.insert(id, (ep, c));
            }
            Incoming::Commit(c) => {
                self.forget(ep, &id);
                match self.registry.commit(&id, sender, c) {
                    Ok((bytes, frames)) => self.reply(ep, &id, Reply::Committed(pb::KvCommitted { bytes, frames })),
                    Err(e) => self.refuse(ep, &id, &e),
                }
            }
            Incoming::Abort(a) => {
                self.forget(ep, &id);
                let _ = self.registry.sender_abort(&id, sender, &a.reason);
            }
        }
    }

    /// A rendezvous frame of `id` finished arriving (handled or not).
    fn arrived(&mut self, id: &str) {
        let left = match self.arriving.get_mut(id) {
            Some(n) => {
                *n = n.saturating_sub(1);
                *n
            }
            None => 0,
        };
        if left == 0 {
            self.arriving.remove(id);
            if let Some((ep, commit)) = self.deferred_commits.remove(id) {
                self.handle(ep, id.to_string(), Some(Incoming::Commit(commit)), &[]);
            }
        }
    }

    fn forget(&mut self, ep: sys::ucp_ep_h, id: &str) {
        if let Some(ids) = self.eps.get_mut(&(ep as usize)) {
            ids.retain(|(t, _)| t != id);
        }
    }

    /// The sender id under which `ep` holds transfer `id` open.
    fn sender(&self, ep: sys::ucp_ep_h, id: &str) -> Option<SenderId> {
        self.eps.get(&(ep as usize))?.iter().find(|(t, _)| t == id).map(|&(_, sender)| sender)
    }
}

/// A frame being received by rendezvous.
struct Staged {
    ctx: *mut Ctx,
    ep: sys::ucp_ep_h,
    id: String,
    message: Option<Incoming>,
    buffer: Vec<u8>,
}

unsafe extern "C" fn on_conn_request(request: sys::ucp_conn_request_h, arg: *mut std::ffi::c_void) {
    // SAFETY: `arg` is the thread's Ctx, alive while the listener exists.
    let ctx = unsafe { &mut *(arg as *mut Ctx) };
    ctx.pending.push(request);
}

unsafe extern "C" fn on_ep_error(arg: *mut std::ffi::c_void, ep: sys::ucp_ep_h, _status: sys::ucs_status_t) {
    // SAFETY: `arg` is the thread's Ctx, alive while any endpoint exists.
    let ctx = unsafe { &mut *(arg as *mut Ctx) };
    ctx.failed.push(ep);
}

unsafe extern "C" fn on_rndv_done(
    request: *mut std::ffi::c_void,
    status: sys::ucs_status_t,
    length: usize,
    user: *mut std::ffi::c_void,
) {
    // SAFETY: `user` is the Box<Staged> leaked when the receive started; taken back once here.
    let staged = unsafe { Box::from_raw(user as *mut Staged) };
    // SAFETY: the Ctx outlives every operation on its worker.
    let ctx = unsafe { &mut *staged.ctx };
    let Staged { ep, id, message, mut buffer, .. } = *staged;
    if status == sys::ucs_status_t::UCS_OK {
        // SAFETY: UCX wrote all `length` bytes (the full message) into the buffer's capacity.
        unsafe { buffer.set_len(buffer.capacity().min(length)) };
        ctx.handle(ep, id.clone(), message, &buffer);
    } else {
        // The sender (or the link) failed mid-frame: like a closed stream, forget what arrived
        // and keep the blocks for a retry until the lease ends.
        let _ = status_error("receiving a frame", status);
        if let Some(sender) = ctx.sender(ep, &id) {
            ctx.registry.detach(&id, sender);
        }
    }
    ctx.arrived(&id);
    if !request.is_null() {
        // SAFETY: a request handed to a completion callback is freed by the application.
        unsafe { sys::ucp_request_free(request) };
    }
}

unsafe extern "C" fn on_message(
    arg: *mut std::ffi::c_void,
    header: *const std::ffi::c_void,
    header_length: usize,
    data: *mut std::ffi::c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: UCX passes our Ctx as `arg`, a header of `header_length` bytes, and `param`.
    let (ctx, header, param) =
        unsafe { (&mut *(arg as *mut Ctx), std::slice::from_raw_parts(header as *const u8, header_length), &*param) };
    let ep = param.reply_ep;
    let (id, message) = match envelope::decode::<pb::KvSenderMessage>(header) {
        Ok(decoded) => decoded,
        Err(_) => return sys::ucs_status_t::UCS_ERR_INVALID_PARAM,
    };
    let rndv = param.recv_attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0;
    if !rndv {
        let bytes = if length == 0 || data.is_null() {
            &[][..]
        } else {
            // SAFETY: eager data of `length` bytes, valid during this callback.
            unsafe { std::slice::from_raw_parts(data as *const u8, length) }
        };
        ctx.handle(ep, id, message.message, bytes);
        return sys::ucs_status_t::UCS_OK;
    }
    *ctx.arriving.entry(id.clone()).or_insert(0) += 1;
    // Not zeroed: UCX fills it, and its length is set only once the receive completed.
    let mut staged =
        Box::new(Staged { ctx: ctx as *mut Ctx, ep, id, message: message.message, buffer: Vec::with_capacity(length) });
    let buffer = staged.buffer.as_mut_ptr();
    let user = Box::into_raw(staged) as *mut std::ffi::c_void;
    let mut params = sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
        user_data: user,
        ..Default::default()
    };
    params.cb.recv_am = Some(on_rndv_done);
    // SAFETY: `data` is the rendezvous descriptor of this message; `buffer` (inside the boxed
    // Staged) stays valid until on_rndv_done takes the box back.
    let request = unsafe { sys::ucp_am_recv_data_nbx(ctx.worker, data, buffer as *mut _, length, &params) };
    if request.is_null() {
        // Completed in place: the callback is not called.
        // SAFETY: taking back the box we leaked above, exactly once.
        unsafe { on_rndv_done(ptr::null_mut(), sys::ucs_status_t::UCS_OK, length, user) };
    } else if sys::ucs_ptr_is_err(request) {
        // SAFETY: the receive never started; the box is ours again.
        staged = unsafe { Box::from_raw(user as *mut Staged) };
        let sender = ctx.sender(ep, &staged.id);
        let e = ctx.registry.reject(&staged.id, sender, TransferError::Transport("rendezvous receive failed".into()));
        ctx.refuse(ep, &staged.id, &e);
        ctx.arrived(&staged.id);
    }
    sys::ucs_status_t::UCS_OK
}

/// A running UCX KV receiver.
#[derive(Debug)]
pub struct UcxKvReceiver {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl UcxKvReceiver {
    /// Listens on `bind` (port 0 picks one) and serves `registry` until shut down.
    pub fn start(registry: Arc<KvRegistry>, config: UcxConfig, bind: SocketAddr) -> Result<Self, TransferError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread_stop = stop.clone();
        let thread = std::thread::Builder::new()
            .name("pd-ucx-receiver".into())
            .spawn(move || run(registry, config, bind, thread_stop, ready_tx))
            .map_err(|e| TransferError::Transport(format!("starting the UCX thread: {e}")))?;
        let addr = ready_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| TransferError::Transport("the UCX receiver did not start".into()))??;
        Ok(UcxKvReceiver { addr, stop, thread: Some(thread) })
    }
}

impl crate::KvReceiver for UcxKvReceiver {
    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    async fn shutdown(mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

impl Drop for UcxKvReceiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(
    registry: Arc<KvRegistry>,
    config: UcxConfig,
    bind: SocketAddr,
    stop: Arc<AtomicBool>,
    ready: std::sync::mpsc::Sender<Result<SocketAddr, TransferError>>,
) {
    let worker = match Worker::new(&config) {
        Ok(w) => w,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut ctx = Box::new(Ctx {
        registry,
        worker: worker.worker,
        pending: Vec::new(),
        eps: HashMap::new(),
        failed: Vec::new(),
        replies: Vec::new(),
        arriving: HashMap::new(),
        deferred_commits: HashMap::new(),
    });
    let ctx_ptr = &mut *ctx as *mut Ctx as *mut std::ffi::c_void;
    let listener = match listen(&worker, bind, ctx_ptr) {
        Ok(l) => l,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    if let Err(e) = worker.set_am_handler(AM_TO_RECEIVER, Some(on_message), ctx_ptr) {
        let _ = ready.send(Err(e));
        // SAFETY: created above, destroyed once.
        unsafe { sys::ucp_listener_destroy(listener.0) };
        return;
    }
    let _ = ready.send(Ok(listener.1));
    let mut idle_rounds = 0u32;
    while !stop.load(Ordering::Acquire) {
        let busy = round(&worker, &mut ctx, ctx_ptr);
        if busy {
            idle_rounds = 0;
        } else {
            idle_rounds = idle_rounds.saturating_add(1);
            // Spin briefly for latency, then back off so an idle receiver costs little CPU.
            if idle_rounds > 64 {
                std::thread::sleep(Duration::from_micros(if idle_rounds > 4096 { 1000 } else { 50 }));
            }
        }
    }
    // Let replies already handed to UCX (a commit confirmation) leave before closing.
    let flush_until = std::time::Instant::now() + Duration::from_millis(100);
    while std::time::Instant::now() < flush_until {
        if !worker.progress() {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    let eps: Vec<usize> = ctx.eps.keys().copied().collect();
    for ep in eps {
        worker.close_ep(ep as sys::ucp_ep_h);
    }
    // SAFETY: created in `listen`, destroyed once, before the worker.
    unsafe { sys::ucp_listener_destroy(listener.0) };
    drop(worker);
    drop(ctx);
}

/// One round of the worker thread: progress, new connections, failed endpoints, replies,
/// expired leases. True when there was anything to do.
fn round(worker: &Worker, ctx: &mut Ctx, ctx_ptr: *mut std::ffi::c_void) -> bool {
    let mut busy = false;
    while worker.progress() {
        busy = true;
    }
    for request in std::mem::take(&mut ctx.pending) {
        busy = true;
        accept(worker, request, ctx_ptr);
    }
    for ep in std::mem::take(&mut ctx.failed) {
        busy = true;
        // UCX may report one endpoint more than once (also while closing it): close only
        // endpoints still known, once.
        let Some(ids) = ctx.eps.remove(&(ep as usize)) else { continue };
        for (id, sender) in ids {
            ctx.registry.detach(&id, sender); // the lease frees the blocks if no retry comes
        }
        ctx.replies.retain(|(to, _)| *to != ep);
        worker.close_ep(ep);
    }
    for (ep, body) in std::mem::take(&mut ctx.replies) {
        busy = true;
        if ctx.eps.contains_key(&(ep as usize)) {
            send_reply(worker, ep, &body);
        }
    }
    ctx.registry.expire_due();
    busy
}

fn listen(
    worker: &Worker,
    bind: SocketAddr,
    ctx: *mut std::ffi::c_void,
) -> Result<(sys::ucp_listener_h, SocketAddr), TransferError> {
    let (storage, len) = sockaddr(bind);
    let mut params = sys::ucp_listener_params_t {
        field_mask: (sys::UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | sys::UCP_LISTENER_PARAM_FIELD_CONN_HANDLER) as u64,
        sockaddr: sys::ucs_sock_addr_t { addr: &storage as *const _ as *const sys::sockaddr, addrlen: len },
        ..Default::default()
    };
    params.conn_handler.cb = Some(on_conn_request);
    params.conn_handler.arg = ctx;
    let mut listener: sys::ucp_listener_h = ptr::null_mut();
    // SAFETY: valid worker and params; `storage` outlives the call.
    check("ucp_listener_create", unsafe { sys::ucp_listener_create(worker.worker, &params, &mut listener) })?;
    let mut attr =
        sys::ucp_listener_attr_t { field_mask: sys::UCP_LISTENER_ATTR_FIELD_SOCKADDR as u64, ..Default::default() };
    // SAFETY: valid listener; attr is written by UCX.
    let queried = check("ucp_listener_query", unsafe { sys::ucp_listener_query(listener, &mut attr) });
    // SAFETY: attr.sockaddr was filled by ucp_listener_query.
    let addr = queried.ok().and_then(|_| unsafe { super::worker::socket_addr(&attr.sockaddr) });
    match addr {
        Some(addr) => Ok((listener, addr)),
        None => {
            // SAFETY: created above, destroyed once.
            unsafe { sys::ucp_listener_destroy(listener) };
            Err(TransferError::Transport("could not read the UCX listener's address".into()))
        }
    }
}

fn accept(worker: &Worker, request: sys::ucp_conn_request_h, ctx: *mut std::ffi::c_void) {
    let mut params = sys::ucp_ep_params_t {
        field_mask: (sys::UCP_EP_PARAM_FIELD_CONN_REQUEST
            | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
            | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
        conn_request: request,
        err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
        ..Default::default()
    };
    params.err_handler.cb = Some(on_ep_error);
    params.err_handler.arg = ctx;
    let mut ep: sys::ucp_ep_h = ptr::null_mut();
    // SAFETY: a connection request from our listener, accepted once.
    let status = unsafe { sys::ucp_ep_create(worker.worker, &params, &mut ep) };
    if status == sys::ucs_status_t::UCS_OK {
        // SAFETY: ctx is the live Ctx of this thread.
        unsafe { (*(ctx as *mut Ctx)).eps.insert(ep as usize, Vec::new()) };
    }
}

unsafe extern "C" fn on_reply_sent(
    request: *mut std::ffi::c_void,
    _status: sys::ucs_status_t,
    user: *mut std::ffi::c_void,
) {
    // SAFETY: `user` is the boxed reply body leaked at send time; freed once here.
    drop(unsafe { Box::from_raw(user as *mut Vec<u8>) });
    // SAFETY: requests handed to callbacks are freed by the application.
    unsafe { sys::ucp_request_free(request) };
}

fn send_reply(worker: &Worker, ep: sys::ucp_ep_h, body: &[u8]) {
    let boxed = Box::new(body.to_vec());
    let (ptr_, len) = (boxed.as_ptr(), boxed.len());
    let user = Box::into_raw(boxed) as *mut std::ffi::c_void;
    let mut params = sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
        user_data: user,
        ..Default::default()
    };
    params.cb.send = Some(on_reply_sent);
    // SAFETY: `ep` is live; the header buffer stays alive until the send completes.
    let request = unsafe { sys::ucp_am_send_nbx(ep, AM_TO_SENDER, ptr_ as *const _, len, ptr::null(), 0, &params) };
    if !sys::ucs_ptr_is_ptr(request) {
        // Completed at once (or failed): the callback will not run.
        // SAFETY: taking back the box leaked above, once.
        drop(unsafe { Box::from_raw(user as *mut Vec<u8>) });
    }
    let _ = worker;
}
