// The attention loops for bf16 queries: half of their instantiations, the other half being
// attention_f32.cpp's (attention_plan.h says why two files).
#include "attention_loops.h"

namespace iterserve::attention {
template void run_items<at::BFloat16>(const Plan& plan, bool int8_cache, bool parallel);
}  // namespace iterserve::attention
