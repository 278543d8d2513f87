# Sourced by examples/compression_study.sh and examples/compression_long_budget.sh.
# codec SECTION NAME: the overrides of one codec, on the wire section's uplink (DiLoCo, Di-PS) or on
# HALoS's local-to-global link (SECTION=halos: it crosses the WAN; the workers' sends to their
# local server stay in the region, at wire.up).
codec() {
  local base="wire.up=fp32 wire.down=fp32" c="$1.compress" r="$1.compress_ratio=0.01 $1.compress_values=int2"
  case "$2" in
    fp32) echo "$base" ;;
    bf16) echo "wire.up=bf16 wire.down=fp32" ;;
    int4) echo "$base $c=int4 $1.error_feedback=false" ;;
    int2-ef) echo "$base $c=int2 $1.error_feedback=true" ;;
    topk-int2-ef) echo "$base $c=topk $r $1.error_feedback=true" ;;
    dct-int2-ef) echo "$base $c=dct_topk $r $1.error_feedback=true" ;;
    # DCT top-2 %, int2 values (151x fewer bytes than fp32)
    dct2-int2-ef) echo "$base $c=dct_topk $1.compress_ratio=0.02 $1.compress_values=int2 $1.error_feedback=true" ;;
    # the same with error feedback decaying by BETA a step: dct2-int2-efdBETA (dct2-int2-efd0.9)
    dct2-int2-efd*) echo "$base $c=dct_topk $1.compress_ratio=0.02 $1.compress_values=int2 $1.error_feedback=true $1.error_feedback_decay=${2#dct2-int2-efd}" ;;
    # finer values for the kept entries: DCT top-1 % with int8 (168x fewer bytes than fp32) and
    # DCT top-2 % with int4 (134x)
    dct-int8-ef) echo "$base $c=dct_topk $1.compress_ratio=0.01 $1.compress_values=int8 $1.error_feedback=true" ;;
    dct2-int4-ef) echo "$base $c=dct_topk $1.compress_ratio=0.02 $1.compress_values=int4 $1.error_feedback=true" ;;
    # 1-bit values (the sign and the block's mean magnitude): DCT top-1 % (295x) and top-2 % (177x)
    dct-sign-ef) echo "$base $c=dct_topk $1.compress_ratio=0.01 $1.compress_values=sign $1.error_feedback=true" ;;
    dct2-sign-ef) echo "$base $c=dct_topk $1.compress_ratio=0.02 $1.compress_values=sign $1.error_feedback=true" ;;
    # any density: DCT top-P %, int2 values, error feedback decaying by BETA: dctpP-int2-efdBETA
    # (dctp5-int2-efd0.9 keeps 5 % of each chunk; BETA 1 is plain error feedback)
    dctp*-int2-efd*)
      local rest=${2#dctp}
      echo "$base $c=dct_topk $1.compress_ratio=$(awk "BEGIN { print ${rest%%-*} / 100 }") $1.compress_values=int2 $1.error_feedback=true $1.error_feedback_decay=${rest##*-efd}" ;;
    *) echo "unknown codec '$2' (see examples/compression_codecs.sh)" >&2; return 2 ;;
  esac
}
