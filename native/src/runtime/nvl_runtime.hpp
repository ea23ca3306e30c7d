// Per-rank NVL buffer runtime: one device allocation of num_nvl_bytes shared with the other local ranks by
// CUDA/HIP IPC, host-mapped counters and the diagnostic record, and the peer pointer table the kernels get.
// Lifecycle: construct (allocates, zeroes) -> ipc_handle() on every rank -> exchange the bytes over the
// process group -> connect(all handles) -> kernels -> destroy() (idempotent; also run by the destructor).
// Plain C++ header: the bindings include it without a GPU compiler.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../kernels/intranode/intranode.hpp"
#include "uccl_moe/diag.hpp"
#include "uccl_moe/timeout.hpp"

namespace uccl_moe::runtime {

class NvlRuntime {
 public:
  /// rank/num_ranks: local rank and local ranks (1..8); device: the GPU this rank drives.
  NvlRuntime(int rank, int num_ranks, int64_t num_nvl_bytes, int device);
  ~NvlRuntime();
  NvlRuntime(const NvlRuntime&) = delete;
  NvlRuntime& operator=(const NvlRuntime&) = delete;

  /// Opaque IPC handle bytes of this rank's buffer (to be all-gathered).
  std::string ipc_handle() const;
  /// Opens every peer's buffer from the gathered handles (index = local rank; ours is skipped).
  void connect(const std::vector<std::string>& handles);
  bool connected() const { return connected_; }
  void destroy();

  int rank() const { return rank_; }
  /// Rank named in diagnostics when this node is one of several (default: the local rank).
  void set_global_rank(int r) { global_rank_ = r; }
  int num_ranks() const { return num_ranks_; }
  int64_t num_nvl_bytes() const { return num_nvl_bytes_; }
  uintptr_t local_buffer() const { return reinterpret_cast<uintptr_t>(local_); }
  /// Kernel view (throws if not connected or destroyed).
  intranode::NvlContext context() const;

  /// Host side of the receive counters: set to -1 before a notify that publishes them.
  void reset_recv_counter();
  /// Waits until notify published the counts: the rows this rank receives, the most rows any local rank receives
  /// and the most any receives from other ranks (both the same on every rank), the per-local-expert counts and the
  /// [N, N] rank prefix matrix (the handle's, the same on every rank: a copy-engine combine sizes its copies by it)
  /// and every rank's token count (a copy-engine dispatch's).
  /// Bounded by timeout().host_behind_device_s(). Returns false on timeout/abort; the diagnostic record then says
  /// why (a host-side record is written if the GPU wrote none).
  bool wait_recv_counts(int num_local_experts, int* num_recv, int* most_recv, int* most_remote,
                        std::vector<int>* per_expert, std::vector<int>* rank_prefix, std::vector<int>* rank_tokens);
  /// UCCL_MOE_TIMEOUT_S, resolved when this runtime was created: every wait of its kernels and of its host.
  const Timeout& timeout() const { return timeout_; }
  /// True once any wait of this buffer gave up; the buffer is then unusable (recreate it).
  bool aborted() const;
  DiagRecord diag() const;
  /// Device view of the host-mapped TopkFault the layout and topk checks record a bad expert id in.
  uintptr_t topk_fault_device() const;
  /// The recorded TopkFault (state 2), cleared so the next one can be recorded; state 0 if none. No device sync.
  TopkFault take_topk_fault();

  /// Channel count the ring counters were last reset for (-1: never). Rounds with the same count chain
  /// without a reset (nvl_layout.hpp); the bindings reset when it changes. Every rank sees the same calls,
  /// so every rank takes the same decision.
  int ring_channels() const { return ring_channels_; }
  void set_ring_channels(int c) { ring_channels_ = c; }
  /// Before enqueueing an op with `channels` on `stream`: throws InvalidUsage if a CUDA graph was captured with
  /// another channel count (replays would re-lay the rings behind the host's back), and remembers the count
  /// when `stream` is capturing.
  void check_graph_channels(int channels, void* stream);
  /// Before an op with `num_sms` blocks: throws InvalidUsage if the GPU has fewer SMs. Every block of a
  /// dispatch or combine must be resident at once (a sender spins until its channel's receiver drains the ring),
  /// so a larger grid would run some channels only after others finished, or time out.
  void check_num_sms(int num_sms) const;
  /// SMs / CUs of the device (0: unknown).
  int device_sms() const { return device_sms_; }
  /// The lane geometry of an op with `num_sms` blocks and these Config chunk sizes on this buffer: the one place it
  /// is computed (check_num_sms, then intranode::placed_geometry for this buffer). Throws
  /// InvalidUsage naming the Config field to change.
  intranode::Geometry geometry(int num_sms, int nvl_send_tokens, int nvl_recv_tokens) const;
  /// What a copy-engine op enqueued now on `stream` needs: the streams and events of the copy-engine ops (created
  /// by connect() on this runtime's device, so never inside a CUDA graph capture; kept until destroy), with
  /// `rank_prefix_host` ([N, N], held by the caller for the launch), and whether its copies start before any
  /// hand-shake (CeCopies::early, counted in ce_early_ops): `early_wanted` (UCCL_MOE_CE_EARLY), the op launched last
  /// on this Buffer ended with every rank's done release (note_op), no op of this Buffer was ever captured in a CUDA
  /// graph (a replay's first op follows whatever ran before it, which the host does not see) and `stream` is not
  /// capturing. Every rank sees the same calls, so decides alike (a rank that does not is caught by the op's checks
  /// as a different op would be).
  /// A polled op (`polled`: a polled combine or dispatch) is early only behind a gate (CeCopies::gate): where the
  /// sentinel was set by a side memset after the op before (note_op) and not by begin_op, each copy stream first
  /// waits (a stream memory wait) until its peer's count of side memsets, which the peer's side stream writes into
  /// our meta after each (nvl_layout.hpp sentinel_ready), reached ours: every rank makes the same memsets. Not where
  /// the driver has no stream memory operations (connect() tries them): there a polled op is never early.
  /// `beside_wanted` (UCCL_MOE_CE_END_BESIDE): a gated op on CUDA ends beside its kernel (CeCopies::beside), on the
  /// side stream; the next op's wait_for_sentinel waits for that end (ce_ended_).
  intranode::CeCopies ce_copies(const int32_t* rank_prefix_host, void* stream, bool early_wanted, bool polled = false,
                                bool beside_wanted = false);
  /// The ops of a Buffer, as begin_op and note_op tell them apart (the polled ops' sentinel, below).
  enum OpKind : int {
    kOpNotify,
    kOpRingDispatch,
    kOpDirectDispatch,
    kOpCeDispatch,
    kOpRingCombine,
    kOpPullCombine,
    kOpStage,
    kOpCeCombine,
    kOpPolledCombine,
    kOpPolledDispatch,
    kOpPeerCopy,
    kNumOpKinds
  };
  /// The kinds that poll a landing area (the copy-engine combine under UCCL_MOE_CE_POLL, the copy-engine dispatch
  /// under UCCL_MOE_DISPATCH_CE_POLL).
  static bool polls(int kind) { return kind == kOpPolledCombine || kind == kOpPolledDispatch; }
  /// Whether a copy-engine op enqueued now on `stream` polls its landing area (`wanted`: its knob, above):
  /// not while `stream` captures a CUDA graph and never on a Buffer that had an op captured (a replay runs behind
  /// the host's back, so the host cannot keep the sentinel). Every rank sees the same calls, so decides alike.
  bool ce_poll(void* stream, bool wanted) const;
  /// Before every op's launch on `stream` (the bindings call it first). A polled copy-engine op needs the sentinel (all
  /// ones) in every 32-bit word of its landing area before any peer's copy lands there, and every other op overwrites
  /// it (rings, landing areas, views and the staged rows all start at kOffCombineInput). So after an op of a kind that
  /// a polled op followed last time, note_op sets the sentinel again over that polled kind's last landing area with a
  /// memset on a stream of this runtime's own, which runs beside the caller's work between the ops; here `stream` waits
  /// for that memset (on the host, in the relaxed capture mode, where `stream` captures: an event recorded outside a
  /// capture cannot be waited for inside it). No peer writes into our buffer under it: the first op after it is early
  /// only if it polls, and then each peer's copies wait until our side stream told it the memset ended (ce_copies),
  /// the next ring op resets the rings (two barriers) and every other op enters with a hand-shake that our stream
  /// reaches after the wait. A polled op (`kind` kOpPolledCombine or kOpPolledDispatch, landing area
  /// [kOffCombineInput, `polled_end`): every rank's largest, so that every rank takes the same decisions here and in
  /// note_op) then sets the sentinel where it does not hold with a memset on `stream`, before its enter kernel. Every
  /// kind but notify leaves the area overwritten.
  void begin_op(void* stream, int kind, int64_t polled_end = 0);
  /// After every op's launch: `done` when it ends with the done hand-shake (a combine from the buffer, a
  /// copy-engine op); `kind` as for begin_op. Remembers a capture; sets the sentinel after the op where a polled
  /// op followed this kind last time (begin_op).
  void note_op(void* stream, bool done, int kind);
  /// `stream` waits for the last sentinel memset (begin_op): a get_combine_buffer view is written on the caller's
  /// stream, into the landing area.
  void wait_for_sentinel(void* stream);
  /// The landing area was written behind this runtime's back (the bench's one-sided peer copies into it): the next
  /// polled op sets the sentinel over all of its area first.
  void forget_sentinel() { sentinel_end_ = 0; }
  /// Polled ops (combines and dispatches), sentinel memsets before a polled op (on its stream) and after an op (on
  /// the side stream), since the Buffer was made (tests: which path ran).
  int64_t ce_polled_ops() const { return ce_polled_ops_; }
  int64_t ce_polled_dispatches() const { return ce_polled_dispatches_; }
  int64_t ce_sentinel_sets() const { return ce_sentinel_sets_; }
  int64_t ce_sentinel_side_sets() const { return ce_sentinel_side_sets_; }
  /// Copy-engine ops that started their copies at once, since the Buffer was made (tests: the path was taken); of
  /// them, the polled ones behind the gate (ce_copies).
  int64_t ce_early_ops() const { return ce_early_ops_; }
  int64_t ce_gated_ops() const { return ce_gated_ops_; }
  int64_t ce_ended_beside() const { return ended_seq_; }  // ops classified so (ce_copies), before their launch
  /// Whether the driver's stream memory operations worked here (connect()): polled ops may then be early.
  bool ce_gate_ok() const { return gate_ok_; }

 private:
  int rank_, num_ranks_, device_;
  int global_rank_ = -1;
  Timeout timeout_;
  int64_t num_nvl_bytes_;
  void* local_ = nullptr;
  void* peers_[kMaxLocalRanks] = {};
  bool connected_ = false;
  bool destroyed_ = false;
  int ring_channels_ = -1;
  int graph_channels_ = -1;  // channel count of the ops captured in CUDA graphs (-1: none captured)
  bool after_done_ = false;  // the last op launched ended with the done hand-shake (note_op)
  bool captured_ = false;    // an op of this Buffer was captured in a CUDA graph
  int64_t ce_early_ops_ = 0, ce_gated_ops_ = 0;
  bool gate_ok_ = false;  // stream memory operations work (connect())
  bool pre_set_ = false;  // begin_op set the sentinel for the op being launched on its own stream
  int64_t ce_polled_ops_ = 0, ce_polled_dispatches_ = 0, ce_sentinel_sets_ = 0, ce_sentinel_side_sets_ = 0;
  // The sentinel: bytes [kOffCombineInput, sentinel_end_) hold it once the last memset ran (0: nowhere); per polled
  // kind the end of its last landing area (a side memset's extent); the side memsets enqueued, and how many of
  // them waited_stream_ last waited for; a side memset no cross-rank hand-shake followed yet (no early op then).
  int64_t sentinel_end_ = 0, poll_end_[kNumOpKinds] = {};
  int64_t sentinel_seq_ = 0, waited_seq_ = 0;
  int64_t ended_seq_ = 0, waited_ended_seq_ = 0;  // ops that ended beside (ce_ended_ recorded after the last one)
  void* ce_end_after_ = nullptr;  // recorded on the caller's stream after an op's kernel; the side stream waits for it
  void* ce_ended_ = nullptr;      // recorded on the side stream after that op's end kernel
  void* waited_stream_ = nullptr;
  bool sentinel_unfenced_ = false;
  // The kind of the op before, and per kind the kind that followed it last time (-1: none yet).
  int last_kind_ = -1;
  int next_kind_[kNumOpKinds];  // set to -1 by the constructor
  void* sentinel_stream_ = nullptr;  // the side memsets' stream, and its events (after the op, after the memset)
  void* sentinel_after_ = nullptr;
  void* sentinel_set_ = nullptr;
  int device_sms_ = 0;       // SMs / CUs of device_ (0: unknown, no check)
  // No op of this Buffer was captured in a CUDA graph and `stream` is not capturing: the host sees every op's order
  // (early copies and polling rest on it).
  bool outside_graphs(void* stream) const;
  void make_ce_streams();  // connect(): the copy-engine ops' streams and events
  void* ce_streams_[kMaxLocalRanks] = {};  // copy-engine ops: a stream per peer, and its events (ce_copies)
  void* ce_entered_ = nullptr;
  void* ce_copied_[kMaxLocalRanks] = {};
  char* host_ = nullptr;   // host-mapped block: DiagRecord | abort flag | recv counter | expert counters
  char* host_dev_ = nullptr;
};

}  // namespace uccl_moe::runtime
